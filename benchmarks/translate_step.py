"""Milliseconds per training step of translation recipes, through `qkv train translate`'s own loop.

Each recipe is a JSON object of settings over the translation recipe; the loop runs with evaluation and checkpoints off
(Hooks(evaluate=False)) and its on_step hook times every step; the first 10 steps (warm-up, compilation)
are not counted. Run the recipes in one invocation so that they share the machine's state.

    python benchmarks/translate_step.py '{}' '{"compile": true}' '{"model": {"d_model": 256, "d_ff": 1024}}'
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from qkv.tasks import recipe, train
from qkv.training import Hooks, StepInfo

WARMUP = 10


def step_times(settings: dict[str, object], steps: int) -> list[float]:
    """Seconds of each training step after the warm-up."""
    times: list[float] = []
    last = time.perf_counter()

    def on_step(_: StepInfo) -> None:
        nonlocal last
        now = time.perf_counter()
        times.append(now - last)
        last = now

    config = recipe("translate", {"corpus": "bible", "max_time": None, **settings, "max_steps": steps})
    train(config, verbose=False, hooks=Hooks(on_step=on_step, evaluate=False))
    return times[WARMUP:]


def main() -> None:
    """Time each recipe and print its median and mean step."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("recipes", nargs="+", help="JSON objects of settings over the translation recipe")
    parser.add_argument("--steps", type=int, default=60)
    args = parser.parse_args()
    for settings in args.recipes:
        times = step_times(json.loads(settings), args.steps)
        print(f"{settings}: median {statistics.median(times) * 1e3:.0f} ms/step, "
              f"mean {statistics.mean(times) * 1e3:.0f} ms/step over {len(times)} steps")  # fmt: skip


if __name__ == "__main__":
    main()
