"""Training throughput: tokens/s and MFU of a language-model shape on this machine, through `qkv train`'s own loop.

The steps are the training loop's (qkv.training.loop: batches from the embedded corpus, forward, backward,
fused AdamW), timed through its on_step hook, with evaluation and checkpoints off: one window from the end
of the first --warmup steps to the last step, synchronised with the device at both ends. MFU (model FLOPs
utilisation) = model FLOPs per second / peak matmul FLOP/s, with the peak measured in the same run (large
square matmuls), so the ratio means the same on any machine: on the CPU the best fp32 2048² product; on CUDA
the mean of ten 8192² products in the run's dtype (bf16 for --dtype bfloat16) after three warm-ups. Model
FLOPs per token follow the PaLM/nanoGPT estimate: 6·N (forward + backward through the non-embedding weights,
including the output head) + 12·L·T·d (attention scores and mixing).

    python benchmarks/train_throughput.py                         # the default `qkv train` shape
    python benchmarks/train_throughput.py --n-layers 6 --d-model 384 --n-heads 6 --block-size 256 --batch-size 64
    # GPT-2 124M's shape on a GPU: bf16 autocast, torch.compile, AdamW, a 50,304-entry vocabulary (the char
    # corpus uses 78 of them; the head's matmul costs what GPT-2's does)
    python benchmarks/train_throughput.py --gpt --n-layers 12 --d-model 768 --n-heads 12 --n-kv-heads 12 \
        --block-size 1024 --batch-size 32 --vocab-size 50304 --optimizer adamw --device cuda --dtype bfloat16 --compile
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

from qkv import DecoderLM
from qkv.bench import save_report
from qkv.io import DTYPES
from qkv.io.devices import resolve_device
from qkv.tasks import recipe, train
from qkv.tasks.lm import LMConfig
from qkv.training import Hooks, StepInfo

# nanoGPT's block: learned positions, LayerNorm, GELU, biases (DecoderLMConfig's own defaults).
GPT_BLOCK = {"positions": "learned", "norm": "layer", "activation": "gelu", "bias": True, "dropout": 0.0}


@dataclass
class Throughput:
    """One measurement."""

    tokens_per_s: float
    ms_per_step: float
    model_tflops_per_s: float
    peak_tflops_per_s: float
    mfu: float
    params_m: float
    flops_per_token: float


def peak_matmul_flops(n: int = 2048, repeats: int = 10, device: str = "cpu", dtype: str = "float32") -> float:
    """Peak FLOP/s of an n×n @ n×n matmul (2·n³ FLOPs each): CPU, the best of `repeats`; CUDA, see cuda_matmul_flops."""
    if torch.device(device).type == "cuda":
        return cuda_matmul_flops(device=device, dtype=dtype, repeats=repeats)
    a, b = torch.randn(n, n), torch.randn(n, n)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best


def cuda_matmul_flops(n: int = 8192, repeats: int = 10, device: str = "cuda", dtype: str = "bfloat16",
                      warmup: int = 3) -> float:  # fmt: skip
    """Mean FLOP/s of `repeats` n³ matmuls in `dtype` on a GPU after `warmup` ones, timed by CUDA events."""
    a, b = (torch.randn(n, n, device=device, dtype=getattr(torch, dtype)) for _ in range(2))
    for _ in range(warmup):  # clocks up, cuBLAS picks its kernel
        a @ b
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        a @ b
    end.record()
    torch.cuda.synchronize()
    return 2 * n**3 * repeats / (start.elapsed_time(end) / 1000)


def flops_per_token(model: DecoderLM) -> float:
    """6·N_non-embedding + 12·L·T·d; the tied head counts as a matmul, the position table does not."""
    cfg = model.cfg
    n = sum(p.numel() for p in model.parameters())
    n -= 0 if cfg.tie_embeddings else model.embed.tokens.weight.numel()  # an untied input table is a lookup
    if model.embed.positions is not None:
        n -= sum(p.numel() for p in model.embed.positions.parameters())
    return 6 * n + 12 * cfg.decoder.n_layers * cfg.context_length * cfg.d_model


def widen_vocab(model: DecoderLM, vocab_size: int) -> None:
    """Give the model a `vocab_size`-entry embedding and head (tied as before), freshly initialised, in place."""
    weight = model.embed.tokens.weight
    model.embed.tokens = nn.Embedding(vocab_size, weight.shape[1], device=weight.device)
    nn.init.normal_(model.embed.tokens.weight, std=0.02)
    model.embed.vocab_size = vocab_size
    model.lm_head = nn.Linear(weight.shape[1], vocab_size, bias=False, device=weight.device)
    if model.cfg.tie_embeddings:
        model.lm_head.weight = model.embed.tokens.weight
    model.cfg = dataclasses.replace(model.cfg, vocab_size=vocab_size)


def measure(cfg: LMConfig, warmup: int = 3, vocab_size: int | None = None) -> Throughput:
    """Train cfg.max_steps steps with the loop's hooks; time the steps after the warm-up ones as one window.

    The loop does not wait for a GPU between steps, so the window is closed by synchronising with the device at
    both ends: what it times is the device's work, with the host's preparation overlapping it.
    vocab_size: widen the model's vocabulary to this (the data's tokens stay a subset), e.g. GPT-2's on the
    char corpus: the head's matmul then costs what it costs in GPT-2.
    """
    steps = cfg.schedule.max_steps
    if steps <= warmup:
        raise SystemExit(f"--steps must exceed the {warmup} warm-up steps")
    models: list[nn.Module] = []
    marks: dict[int, float] = {}
    tokens: list[int] = []

    def on_model(model: nn.Module) -> None:  # before compile, wrapping and the optimiser: they see the new tables
        if vocab_size is not None:
            assert isinstance(model, DecoderLM)
            widen_vocab(model, vocab_size)
        models.append(model)

    def on_step(info: StepInfo) -> None:
        if info.step > warmup:
            tokens.append(info.tokens)
        if info.step in (warmup, steps):  # the window's ends: the device's queue drained
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            marks[info.step] = time.perf_counter()

    device, dtype = str(resolve_device(cfg.system.device)), cfg.system.dtype
    peak = peak_matmul_flops(device=device, dtype=dtype)  # on a GPU, in the dtype the matmuls run in
    train(cfg, verbose=False, hooks=Hooks(on_model=on_model, on_step=on_step, evaluate=False))
    peak = max(peak, peak_matmul_flops(device=device, dtype=dtype))  # before and after: the best is the peak
    elapsed = marks[steps] - marks[warmup]
    tokens_per_s = sum(tokens) / elapsed
    model = models[0]
    assert isinstance(model, DecoderLM)
    fpt = flops_per_token(model)
    achieved = tokens_per_s * fpt
    return Throughput(
        tokens_per_s, elapsed / len(tokens) * 1000, achieved / 1e12, peak / 1e12, achieved / peak,
        sum(p.numel() for p in model.parameters()) / 1e6, fpt,
    )  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    """Parse a model shape, measure, print a table and JSON."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    defaults = recipe("lm")
    model_defaults, attention = defaults.model, defaults.model.decoder.block.attention
    p.add_argument("--n-layers", type=int, default=model_defaults.decoder.n_layers)
    p.add_argument("--d-model", type=int, default=model_defaults.d_model)
    p.add_argument("--n-heads", type=int, default=attention.n_heads)
    p.add_argument("--n-kv-heads", type=int, default=getattr(attention, "n_kv_heads", None),
                   help="key/value heads (the recipe's 1, also under --gpt; --n-heads' value: multi-head)")  # fmt: skip
    p.add_argument("--block-size", type=int, default=defaults.block_size)
    p.add_argument("--batch-size", type=int, default=defaults.data.batch_size)
    p.add_argument("--steps", type=int, default=20, help="timed steps (after --warmup more)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--gpt", action="store_true", help="nanoGPT's block (learned positions, LayerNorm, GELU, biases)")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="float32", choices=DTYPES, help="autocast dtype (and the peak's, on CUDA)")
    p.add_argument("--compile", action="store_true", help="torch.compile the model (the loop's --compile)")
    p.add_argument("--optimizer", choices=("adamw", "muon"), help="adamw or muon (default: the task's recipe)")
    p.add_argument("--vocab-size", type=int, help="widen the model's vocabulary to this (default: the corpus's)")
    p.add_argument("--json", help="also write the result to this file")
    args = p.parse_args(argv)
    model: dict[str, Any] = {"n_layers": args.n_layers, "d_model": args.d_model, "n_heads": args.n_heads,
                             "n_kv_heads": args.n_kv_heads}  # fmt: skip
    if args.gpt:
        model |= GPT_BLOCK
    extra = {"optimizer": args.optimizer} if args.optimizer else {}
    cfg = recipe("lm", {"model": model, "block_size": args.block_size, "batch_size": args.batch_size,
                        "device": args.device, "dtype": args.dtype, "compile": args.compile,
                        "max_steps": args.warmup + args.steps, "warmup_steps": 0, "sample_tokens": 0, **extra})
    assert isinstance(cfg, LMConfig)
    result = measure(cfg, args.warmup, args.vocab_size)
    threads = f"{torch.get_num_threads()} threads" if resolve_device(args.device).type == "cpu" else args.device
    vocab = f", vocab {args.vocab_size:,}" if args.vocab_size else ""
    print(f"config: {args.n_layers} layers × {args.d_model}, {args.n_heads} heads ({args.n_kv_heads} key/value), "
          f"block {args.block_size}{vocab}, "
          f"batch {args.batch_size}, {'GPT block' if args.gpt else 'qkv default block'}, {args.dtype}"
          f"{', compiled' if args.compile else ''}, {cfg.optim.name}, {threads}")  # fmt: skip
    print(f"{'params':>10} {'tokens/s':>10} {'ms/step':>9} {'model TFLOP/s':>14} {'peak TFLOP/s':>13} {'MFU':>6}")
    print(f"{result.params_m:>9.2f}M {result.tokens_per_s:>10,.0f} {result.ms_per_step:>9.1f} "
          f"{result.model_tflops_per_s:>14.4f} {result.peak_tflops_per_s:>13.4f} {result.mfu:>6.1%}")  # fmt: skip
    config = {**cfg.to_dict(), "compile": cfg.system.compile}
    save_report(args.json, {"config": config, "batch_size": args.batch_size, "block_size": args.block_size,
                            "device": args.device, **asdict(result)})  # fmt: skip


if __name__ == "__main__":
    main()
