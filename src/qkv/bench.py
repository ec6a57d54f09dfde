"""The repository's benchmark scripts (benchmarks/NAME.py), loaded by name for `qkv bench NAME`.

The scripts live beside src/, not in the package (they are meant to be read and run by hand too), so they are
loaded by path from the source checkout; an installed qkv without the repository has none to run.
"""

from __future__ import annotations

import importlib.util
import json
import sys
import threading
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


def status_bytes(field: str, pid: int | str = "self") -> int:
    """A memory field of /proc/PID/status (VmRSS, VmHWM, RssAnon …) in bytes; 0 for a process that is gone or has
    exited without being waited for (a zombie has no memory fields)."""
    try:
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    except OSError:
        return 0
    return next((int(line.split()[1]) * 1024 for line in lines if line.startswith(field + ":")), 0)  # in kB


def reset_peak_rss() -> int:
    """Return freed heap to the OS, restart this process's peak-RSS mark (VmHWM) at its current RSS, and return
    that RSS in bytes: what a step allocates after it shows as VmHWM − the result."""
    import ctypes

    libc = ctypes.CDLL(None)
    if hasattr(libc, "malloc_trim"):  # glibc
        libc.malloc_trim(0)
    Path("/proc/self/clear_refs").write_text("5")  # "5" resets VmHWM (Linux ≥ 4.0)
    return status_bytes("VmRSS")


def _descendants(root: int) -> list[int]:
    """A process and all its descendants, from /proc."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parents[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    tree, frontier = [root], [root]
    while frontier:
        children = [p for p, parent in parents.items() if parent == frontier[-1]]
        frontier.pop()
        tree += children
        frontier += children
    return tree


class PeakMemory:
    """The peak of a /proc status field of a running process (tree: summed over it and its descendants), sampled
    every 20 ms in a thread until stop()."""

    def __init__(self, pid: int, field: str = "VmRSS", tree: bool = False) -> None:
        self.pid, self.field, self.tree, self.peak = pid, field, tree, 0
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        while not self._done.wait(0.02):
            pids = _descendants(self.pid) if self.tree else [self.pid]
            self.peak = max(self.peak, sum(status_bytes(self.field, pid) for pid in pids))

    def stop(self) -> int:
        """Stop sampling; the peak in bytes."""
        self._done.set()
        self._thread.join()
        return self.peak


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
