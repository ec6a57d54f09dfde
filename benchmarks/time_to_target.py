"""Time to target: wall-clock seconds of `qkv train` (default recipe) until the full-validation loss reaches a target.

The run is qkv.train with the default recipe except for what the options set; every
--eval-interval steps it evaluates on the whole validation split (eval_tokens=None: the `qkv eval` protocol,
evaluate_loss over data.val_ids). The first logged val_loss ≤ --target gives the step and, from metrics.jsonl,
elapsed_s (wall-clock since the loop began, evaluations and checkpoint writes included) and train_s (the training
steps alone: what the run would have taken with no evaluation on the way). The resolution is one eval interval:
the target was crossed somewhere in the interval before. Process start-up (imports, data) is not included; time
the whole command (`time qkv train`) for that.

    python benchmarks/time_to_target.py                            # default recipe, target 1.96, eval every 100
    python benchmarks/time_to_target.py --target 2.2 --max-steps 1000 --eval-interval 50 --json ttt.json
    python benchmarks/time_to_target.py --set lr=1e-3 --set block_size=64 --model positions=learned
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from qkv.bench import save_report
from qkv.cli import key_value
from qkv.errors import QkvError
from qkv.io.devices import resolve_device
from qkv.io.run_dir import read_metrics
from qkv.tasks import recipe, train
from qkv.tasks.lm import LMConfig


def run(cfg: LMConfig, target: float, verbose: bool) -> dict[str, Any]:
    """Train, then find the first evaluation at or below target in metrics.jsonl."""
    result = train(cfg, verbose=verbose)
    rows = read_metrics(Path(result.run_dir), result.step)
    evals = [{k: row[k] for k in ("step", "val_loss", "elapsed_s", "train_s", "tokens_seen")} for row in rows]
    hit = next((e for e in evals if e["val_loss"] <= target), None)
    train_s = rows[-1]["train_s"] if rows else float("nan")
    return {
        "target": target, "reached": hit is not None,
        "step": hit["step"] if hit else None,
        "seconds_to_target": hit["elapsed_s"] if hit else None,
        "train_seconds_to_target": hit["train_s"] if hit else None,
        "final_val_loss": result.val_loss, "steps": result.step, "elapsed_s": result.elapsed_s,
        "tokens_per_s": rows[-1]["tokens_seen"] / train_s if rows else float("nan"),
        "device": str(resolve_device(cfg.system.device)), "threads": torch.get_num_threads(),
        "training": cfg.to_dict(), "evals": evals,
    }  # fmt: skip


def print_table(report: dict[str, Any]) -> None:
    """Each evaluation (loss, elapsed, training-only seconds), then the verdict."""
    cfg = report["training"]
    print(f"Time to full-val loss ≤ {report['target']}: {cfg['schedule']['max_steps']} steps, full-split eval every "
          f"{cfg['eval']['interval']}, {report['tokens_per_s']:,.0f} training tokens/s, {report['device']}, "
          f"{report['threads']} thread(s)\n")  # fmt: skip
    print("| step | val loss | elapsed s | training-only s |\n|---:|---:|---:|---:|")
    for e in report["evals"]:
        mark = " ←" if e["step"] == report["step"] else ""
        print(f"| {e['step']} | {e['val_loss']:.4f}{mark} | {e['elapsed_s']:.1f} | {e['train_s']:.1f} |")
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
    p.add_argument("--set", action="append", type=key_value, default=[], metavar="KEY=VALUE",
                   help="a LMConfig field, as `qkv train --model` reads values (3, 0.1, True, text)")  # fmt: skip
    p.add_argument("--model", action="append", type=key_value, default=[], metavar="KEY=VALUE",
                   help="a model config field")  # fmt: skip
    p.add_argument("--quiet", action="store_true", help="no training progress output")
    p.add_argument("--json", help="also write the results to this file")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    given = {"max_steps": args.max_steps, "data": args.data, "seed": args.seed, "device": args.device}
    settings = {k: v for k, v in given.items() if v is not None}
    fixed = ("eval_interval", "eval_tokens", "sample_tokens", "out_dir", "model")  # what the benchmark sets itself
    for key, value in args.set:
        if key in fixed:
            p.error(f"--set {key}=… is not allowed: the benchmark sets {key} itself (see --help)")
        settings[key] = value
    with tempfile.TemporaryDirectory() as tmp:
        out_dir = args.out_dir or str(Path(tmp) / "run")
        try:
            cfg = recipe("lm", {**settings, "model": dict(args.model), "eval_interval": args.eval_interval,
                                "eval_tokens": None, "sample_tokens": 0, "out_dir": out_dir})
        except QkvError as e:  # an unknown --set key
            p.error(str(e))
        assert isinstance(cfg, LMConfig)
        report = run(cfg, args.target, verbose=not args.quiet)
    print_table(report)
    save_report(args.json, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
