"""`qkv explore`: the Transformer as an interactive page, on your own model.

A local web server (Starlette on uvicorn, 127.0.0.1) serves a small single-page app from static/ and a
JSON API whose numbers come from qkv itself, so that the page and the Python API cannot disagree:

    library.py      the runs the page may open (RUN_DIR and runs/), and nothing outside them
    body.py         a request's JSON fields, each checked with a one-line error
    panels.py       the attention spreadsheet, trainable weights, multi-head shapes, positions and norms (qkv.lab)
    model_panel.py  a run's attention maps, next-token distribution and generation steps
    routes.py       one function per API route
    server.py       the Starlette app, the Host-header check, and serve()
"""
