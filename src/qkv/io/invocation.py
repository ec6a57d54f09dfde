"""How the user started qkv, so that the commands a run suggests next can be typed as they are printed."""

from __future__ import annotations

import os
import shlex
import shutil
import sys
from pathlib import Path


def _as_typed(path: str) -> str:
    """A path relative to the working directory when it lies inside it (`.venv/bin/qkv`), else absolute."""
    full = Path(path).absolute()
    try:
        return shlex.quote(str(full.relative_to(Path.cwd())))
    except ValueError:
        return shlex.quote(str(full))


def program() -> str:
    """The command that runs qkv here: `qkv` when that is on PATH, else the venv's script or `python -m qkv`."""
    argv0 = sys.argv[0] if sys.argv else ""
    if Path(argv0).name == "__main__.py":  # python -m qkv
        return f"{_as_typed(sys.executable)} -m qkv"
    if Path(argv0).name != "qkv":  # imported as a library: the console script is the one to suggest
        argv0 = str(Path(sys.executable).with_name("qkv"))
    on_path = shutil.which("qkv")
    if on_path and os.path.realpath(on_path) == os.path.realpath(argv0):
        return "qkv"
    return _as_typed(argv0)
