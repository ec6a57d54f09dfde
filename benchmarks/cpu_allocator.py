"""Training steps with and without qkv's allocator setting (qkv.io.devices.keep_freed_memory), side by side.

glibc returns large freed blocks to the OS and maps them again on the next allocation, so every training
step on a CPU page-faults its activations back in. qkv asks glibc to keep them (the training loop does it on
CPU runs). The setting is process-wide and cannot be undone, so each variant runs in its own process,
alternating, through `benchmarks/translate_step.py`; the page faults are the child processes' own.

    python benchmarks/cpu_allocator.py                       # the default translation recipe on the Bible
    python benchmarks/cpu_allocator.py '{"model": {"dropout": 0.0}}' --repeats 3
"""

from __future__ import annotations

import argparse
import re
import resource
import statistics
import subprocess
import sys
from pathlib import Path

STEP = Path(__file__).with_name("translate_step.py")
# Run translate_step.py with keep_freed_memory replaced by a no-op: glibc's defaults.
GLIBC_DEFAULTS = (
    "import runpy, sys, qkv.io.devices as d, qkv.training.loop as loop; "
    "loop.keep_freed_memory = lambda: False; sys.argv = sys.argv[1:]; "
    "runpy.run_path(sys.argv[0], run_name='__main__')"
)


def median_step_ms(recipe: str, steps: int, keep: bool) -> tuple[float, int]:
    """The median step of one process, and the page faults it took."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_minflt
    command = [sys.executable, str(STEP), recipe, "--steps", str(steps)]
    if not keep:
        command = [sys.executable, "-c", GLIBC_DEFAULTS, *command[1:]]
    out = subprocess.run(command, check=True, capture_output=True, text=True).stdout
    faults = resource.getrusage(resource.RUSAGE_CHILDREN).ru_minflt - before
    match = re.search(r"median (\d+) ms/step", out)
    assert match, out
    return float(match.group(1)), faults


def main(argv: list[str] | None = None) -> float:
    """Alternate the two settings, print the medians, their ratio and the page faults; return the ratio."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("recipe", nargs="?", default="{}", help="a JSON object of settings over the translation recipe")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args(argv)
    results: dict[bool, list[tuple[float, int]]] = {True: [], False: []}
    for _ in range(args.repeats):
        for keep in (False, True):
            results[keep].append(median_step_ms(args.recipe, args.steps, keep))
    for keep, label in ((False, "glibc defaults"), (True, "keep_freed_memory")):
        ms = [r[0] for r in results[keep]]
        faults = statistics.mean(r[1] for r in results[keep])
        print(f"{label:>18}: {', '.join(f'{m:.0f}' for m in ms)} ms/step (median of each process); "
              f"{faults / 1e6:.2f} M page faults per process")  # fmt: skip
    ratio = statistics.median(r[0] for r in results[False]) / statistics.median(r[0] for r in results[True])
    print(f"speed-up: {ratio:.2f}×")
    return ratio


if __name__ == "__main__":
    main()
