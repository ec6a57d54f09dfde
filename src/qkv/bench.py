"""The repository's benchmark scripts (benchmarks/NAME.py), loaded by name for `qkv bench NAME`.

The scripts live beside src/, not in the package (they are meant to be read and run by hand too), so they are
loaded by path from the source checkout; an installed qkv without the repository has none to run.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

from qkv.errors import QkvError

# Command name → script in benchmarks/.
BENCHMARKS = {
    "attention": "attention.py",
    "decode": "decode.py",
    "explore": "explore.py",
    "dropout": "dropout.py",
    "throughput": "train_throughput.py",
    "kv-cache": "kv_cache.py",
    "time-to-target": "time_to_target.py",
}
BENCHMARKS_DIR = Path(__file__).resolve().parents[2] / "benchmarks"  # src/qkv/bench.py → repository root


def save_report(path: str | None, report: Any) -> None:
    """Write a benchmark's report as JSON when `--json PATH` was given (the scripts share this)."""
    if path:
        with open(path, "w") as f:
            json.dump(report, f, indent=2)


def load_benchmark(name: str, directory: Path = BENCHMARKS_DIR) -> Any:
    """The benchmark script `name` imported as a module (not run: its `__main__` guard stays closed)."""
    if name not in BENCHMARKS:
        raise QkvError(f"unknown benchmark {name!r}; choose one of: {', '.join(BENCHMARKS)}")
    path = directory / BENCHMARKS[name]
    if not path.is_file():
        raise QkvError(f"{path} not found: `qkv bench` runs the scripts in a source checkout's benchmarks/ directory "
                       "(qkv seems to be installed without the repository)")  # fmt: skip
    spec = importlib.util.spec_from_file_location(f"qkv_bench_{name.replace('-', '_')}", path)
    assert spec is not None and spec.loader is not None, "a .py file always gets a spec"
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses (and pickling) look a class's module up in sys.modules
    spec.loader.exec_module(module)
    return module
