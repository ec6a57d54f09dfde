"""Time to target: wall-clock seconds of `qkv train` (default recipe) until the full-validation loss reaches a target.

The run is qkv.train with TrainConfig's defaults (the default recipe) except for what the options set; every
--eval-interval steps it evaluates on the whole validation split (eval_tokens=None: the `qkv eval` protocol,
evaluate_loss over data.val_ids). The first logged val_loss ≤ --target gives the step and metrics.jsonl's elapsed_s.
elapsed_s includes the evaluations (and the checkpoint writes between them), so the benchmark also times each
evaluation and each checkpoint write as it happens and reports training-only seconds = elapsed_s minus that
overhead. The resolution is one eval interval: the target was crossed somewhere in the interval before.

    python benchmarks/time_to_target.py                            # default recipe, target 1.96, eval every 100
    python benchmarks/time_to_target.py --target 2.2 --max-steps 1000 --eval-interval 50 --json ttt.json
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from qkv.bench import save_report
from qkv.training import TrainConfig, distributed, train
from qkv.training import trainer as trainer_module
from qkv.training.common import read_metrics

# What the training loop does at a checkpoint besides training: timed so it can be subtracted from elapsed_s.
SAVES = ("plot_losses", "save_training_state", "atomic_save_safetensors", "_write_metrics")


@contextlib.contextmanager
def overhead_timer() -> Iterator[dict[str, Any]]:
    """Time every evaluation and checkpoint write of the runs inside; yields the running totals.

    The trainer offers no hook, so its module-level helpers are wrapped for the duration (and restored after).
    "at_eval" holds, for each evaluation, the overhead seconds up to its end: what elapsed_s of that row includes.
    """
    totals: dict[str, Any] = {"eval_s": 0.0, "save_s": 0.0, "evals": [], "at_eval": []}

    def timed(fn: Callable[..., Any], kind: str) -> Callable[..., Any]:
        """fn, adding its duration to totals[kind]."""

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            start = time.monotonic()
            try:
                return fn(*args, **kwargs)
            finally:
                seconds = time.monotonic() - start
                totals[kind] += seconds
                if kind == "eval_s":
                    totals["evals"].append(seconds)
                    totals["at_eval"].append(totals["eval_s"] + totals["save_s"])

        return wrapper

    originals = {name: getattr(trainer_module, name) for name in SAVES}
    original_eval = distributed.sharded_eval_loss
    try:
        for name, fn in originals.items():
            setattr(trainer_module, name, timed(fn, "save_s"))
        distributed.sharded_eval_loss = timed(original_eval, "eval_s")
        yield totals
    finally:
        for name, fn in originals.items():
            setattr(trainer_module, name, fn)
        distributed.sharded_eval_loss = original_eval


def run(cfg: TrainConfig, target: float, verbose: bool) -> dict[str, Any]:
    """Train, then find the first evaluation at or below target in metrics.jsonl."""
    with overhead_timer() as totals:
        result = train(cfg, verbose=verbose)
    rows = read_metrics(Path(result.run_dir), result.step)
    evals = []
    for i, row in enumerate(rows):
        overhead = totals["at_eval"][i] if i < len(totals["at_eval"]) else float("nan")
        evals.append({"step": row["step"], "val_loss": row["val_loss"], "elapsed_s": row["elapsed_s"],
                      "train_only_s": row["elapsed_s"] - overhead})  # fmt: skip
    hit = next((e for e in evals if e["val_loss"] <= target), None)
    return {
        "target": target, "reached": hit is not None,
        "step": hit["step"] if hit else None,
        "seconds_to_target": hit["elapsed_s"] if hit else None,
        "train_seconds_to_target": hit["train_only_s"] if hit else None,
        "final_val_loss": result.val_loss, "steps": result.step, "elapsed_s": result.elapsed_s,
        "eval_s_mean": sum(totals["evals"]) / len(totals["evals"]) if totals["evals"] else 0.0,
        "checkpoint_write_s_total": totals["save_s"],
        "device": str(trainer_module.resolve_device(cfg.device)), "threads": torch.get_num_threads(),
        "training": cfg.to_dict(), "evals": evals,
    }  # fmt: skip


def print_table(report: dict[str, Any]) -> None:
    """Each evaluation (loss, elapsed, training-only seconds), then the verdict."""
    cfg = report["training"]
    print(f"Time to full-val loss ≤ {report['target']}: default recipe, {cfg['max_steps']} steps, full-split eval "
          f"every {cfg['eval_interval']} (mean {report['eval_s_mean']:.2f} s each), {report['device']}, "
          f"{report['threads']} thread(s)\n")  # fmt: skip
    print("| step | val loss | elapsed s | training-only s |\n|---:|---:|---:|---:|")
    for e in report["evals"]:
        mark = " ←" if e["step"] == report["step"] else ""
        print(f"| {e['step']} | {e['val_loss']:.4f}{mark} | {e['elapsed_s']:.1f} | {e['train_only_s']:.1f} |")
    if report["reached"]:
        print(f"\nreached {report['target']} at step {report['step']}: {report['seconds_to_target']:.1f} s "
              f"wall-clock, {report['train_seconds_to_target']:.1f} s training only")  # fmt: skip
    else:
        print(f"\nnot reached in {report['steps']} steps (final val loss {report['final_val_loss']:.4f})")


def main(argv: list[str] | None = None) -> int:
    """Parse options, train, print the table, optionally write JSON."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", type=float, default=1.96, help="full-validation loss to reach (nats/token)")
    p.add_argument("--max-steps", type=int, help="optimiser steps (default: the recipe's)")
    p.add_argument("--eval-interval", type=int, default=100, help="steps between full-split evaluations")
    p.add_argument("--data", help="text file (default: the embedded Shakespeare corpus)")
    p.add_argument("--device", default="auto")
    p.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's)")
    p.add_argument("--seed", type=int, help="random seed (default: the recipe's)")
    p.add_argument("--out-dir", help="keep the run here (default: a temporary directory, deleted)")
    p.add_argument("--quiet", action="store_true", help="no training progress output")
    p.add_argument("--json", help="also write the results to this file")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    given = {"max_steps": args.max_steps, "data": args.data, "seed": args.seed, "device": args.device}
    with tempfile.TemporaryDirectory() as tmp:
        settings = {k: v for k, v in given.items() if v is not None}
        cfg = TrainConfig(**settings, eval_interval=args.eval_interval, eval_tokens=None, sample_tokens=0,
                          out_dir=args.out_dir or str(Path(tmp) / "run"))  # fmt: skip
        report = run(cfg, args.target, verbose=not args.quiet)
    print_table(report)
    save_report(args.json, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
