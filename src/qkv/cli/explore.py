"""`qkv explore [RUN_DIR]`: the interactive page, served on this machine (qkv.explore)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from qkv.cli.common import CHECKPOINTS, MODEL_HELP


def register(sub: Any) -> None:
    """Add explore to the `qkv` sub-parsers."""
    p = sub.add_parser("explore", help="the Transformer as an interactive page in your browser, on your own model")
    p.set_defaults(handler=cmd_explore)
    p.add_argument("run_dir", nargs="?", metavar="MODEL",
                   help=f"{MODEL_HELP}, to open (default: choose among the runs under --runs)")
    p.add_argument("--runs", default="runs", help="where the page looks for run directories (default: runs)")
    p.add_argument("--host", default="127.0.0.1",
                   help="the address to listen on (default 127.0.0.1: this machine only)")  # fmt: skip
    p.add_argument("--port", type=int, default=0, help="the port (default: a free one)")
    p.add_argument("--no-browser", action="store_true", help="print the address without opening a browser")
    p.add_argument("--checkpoint", default="best", choices=CHECKPOINTS, help="the runs' weights (default best)")
    p.add_argument("--lm", help="the model a SAELens SAE (a directory with cfg.json) reads, for its Features tab")
    p.add_argument("--data", help="with --lm: a `qkv prepare` directory the SAELens SAE's top contexts come from")


def cmd_explore(args: argparse.Namespace) -> int:
    """Serve the page until Ctrl-C."""
    from qkv.errors import QkvError
    from qkv.extras import require

    if not 0 <= args.port <= 65535:
        raise QkvError(f"--port must be between 0 and 65535, got {args.port}")
    for package in ("starlette", "uvicorn"):
        require(package, "explore", "the interactive page")
    from qkv.explore.library import RunLibrary
    from qkv.explore.server import serve

    run_dir = Path(args.run_dir) if args.run_dir is not None else None
    _check_saelens(run_dir, args.lm, args.data)
    if run_dir is not None and args.lm is None:
        from qkv.tasks.checkpoint import model_task

        model_task(run_dir, "MODEL")  # a run, or a checkpoint of a language model; else a one-line error
    library = RunLibrary(run_dir, Path(args.runs), args.checkpoint, args.lm, args.data)
    serve(library, args.host, args.port, open_browser=not args.no_browser)
    print("qkv explore: stopped")
    return 0


def _check_saelens(run_dir: Path | None, lm: str | None, data: str | None) -> None:
    """A SAELens directory needs --lm; --lm and --data go with one. What can be checked without loading the model
    is checked before the server starts (the hook and width are checked when the tab first opens the SAE)."""
    from qkv.data.tokens import open_data
    from qkv.errors import QkvError
    from qkv.finetune.base import base_config
    from qkv.tasks.sae_open import is_saelens, saelens_run

    if data is not None and lm is None:
        raise QkvError("--data goes with --lm: give the model the SAELens SAE reads")
    saelens = run_dir is not None and is_saelens(run_dir)
    if run_dir is not None and lm is not None and not saelens:
        raise QkvError(f"{run_dir} is no SAELens directory (no cfg.json): --lm and --data go with one; drop them")
    if saelens and lm is None:
        raise QkvError(f"{run_dir} is a SAELens SAE: give the model it reads with --lm MODEL (and --data DIR for its "
                       "top contexts)")  # fmt: skip
    if lm is not None:
        base_config(Path(lm), "--lm")  # a model qkv reads, else one line now
    if data is not None:
        open_data(data)
    if run_dir is not None and saelens:
        saelens_run(run_dir, str(lm))  # its cfg.json and weights read and checked
