"""`qkv explore`: the Transformer as an interactive page, on your own model.

A local web server (Starlette on uvicorn, 127.0.0.1) serves a small single-page app from static/ and a
JSON API whose numbers come from qkv itself, so that the page and the Python API cannot disagree:

    library.py      the runs the page may open (RUN_DIR and runs/), and nothing outside them
    body.py         a request's JSON fields, each checked with a one-line error
    panels.py       the attention spreadsheet, trainable weights, multi-head shapes, positions and norms (qkv.lab)
    model_panel.py  a run's attention maps, next-token distribution and generation steps
    inside.py       inside a run (qkv.interpret): the logit lens and every head's induction scores
    jobs.py         background jobs: long computations run step by step in a thread while the page polls them
    patch_jobs.py   activation patching, computed layer by layer as a job
    features.py     an SAE run's latents per token, a latent's dashboard (a job) and steering (qkv.sae.features)
    routes.py       one function per API route
    server.py       the Starlette app, the Host-header check, and serve()
"""
