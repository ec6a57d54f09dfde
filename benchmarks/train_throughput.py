"""Training throughput: tokens/s and MFU of a language-model shape on this machine, through `qkv train`'s own loop.

The steps are the training loop's (qkv.training.loop: batches from the embedded corpus, forward, backward,
fused AdamW), timed by its on_step hook, with evaluation and checkpoints off; the first --warmup steps are
not counted. MFU (model FLOPs utilisation) = model FLOPs per second / peak fp32 matmul FLOP/s, with the peak
measured in the same run (large square matmuls), so the ratio means the same on any machine. Model FLOPs per
token follow the PaLM/nanoGPT estimate: 6·N (forward + backward through the non-embedding weights, including
the output head) + 12·L·T·d (attention scores and mixing).

    python benchmarks/train_throughput.py                         # the default `qkv train` shape
    python benchmarks/train_throughput.py --n-layers 6 --d-model 384 --n-heads 6 --block-size 256 --batch-size 64
"""

from __future__ import annotations

import argparse
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

from qkv import DecoderLM
from qkv.bench import save_report
from qkv.tasks import train
from qkv.tasks.lm import DEFAULT_MODEL, LMConfig
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


def peak_matmul_flops(n: int = 2048, repeats: int = 10) -> float:
    """Best observed fp32 FLOP/s of an n×n @ n×n matmul (2·n³ FLOPs each)."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best


def flops_per_token(model: DecoderLM) -> float:
    """6·N_non-embedding + 12·L·T·d; the tied head counts as a matmul, the position table does not."""
    cfg = model.cfg
    n = sum(p.numel() for p in model.parameters())
    n -= 0 if cfg.tie_embeddings else model.embed.tokens.weight.numel()  # an untied input table is a lookup
    if model.embed.positions is not None:
        n -= sum(p.numel() for p in model.embed.positions.parameters())
    return 6 * n + 12 * cfg.n_layers * cfg.max_positions * cfg.d_model


def measure(cfg: LMConfig, warmup: int = 3) -> Throughput:
    """Train cfg.max_steps steps with the loop's hooks; time every step after the warm-up ones."""
    models: list[nn.Module] = []
    steps: list[StepInfo] = []
    peak = peak_matmul_flops()
    train(cfg, verbose=False, hooks=Hooks(on_model=models.append, on_step=steps.append, evaluate=False))
    peak = max(peak, peak_matmul_flops())  # measured before and after: the best one is the peak
    timed = steps[warmup:]
    seconds = sum(s.seconds for s in timed) / len(timed)
    tokens_per_s = sum(s.tokens for s in timed) / sum(s.seconds for s in timed)
    model = models[0]
    assert isinstance(model, DecoderLM)
    fpt = flops_per_token(model)
    achieved = tokens_per_s * fpt
    return Throughput(
        tokens_per_s, seconds * 1000, achieved / 1e12, peak / 1e12, achieved / peak,
        sum(p.numel() for p in model.parameters()) / 1e6, fpt,
    )  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    """Parse a model shape, measure, print a table and JSON."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    defaults = LMConfig()
    p.add_argument("--n-layers", type=int, default=DEFAULT_MODEL["n_layers"])
    p.add_argument("--d-model", type=int, default=DEFAULT_MODEL["d_model"])
    p.add_argument("--n-heads", type=int, default=DEFAULT_MODEL["n_heads"])
    p.add_argument("--block-size", type=int, default=defaults.block_size)
    p.add_argument("--batch-size", type=int, default=defaults.batch_size)
    p.add_argument("--steps", type=int, default=20, help="timed steps (after --warmup more)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--gpt", action="store_true", help="nanoGPT's block (learned positions, LayerNorm, GELU, biases)")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--json", help="also write the result to this file")
    args = p.parse_args(argv)
    model: dict[str, Any] = {"n_layers": args.n_layers, "d_model": args.d_model, "n_heads": args.n_heads}
    if args.gpt:
        model |= GPT_BLOCK
    cfg = LMConfig(model=model, block_size=args.block_size, batch_size=args.batch_size, device=args.device,
                   dtype=args.dtype, max_steps=args.warmup + args.steps, warmup_steps=0, sample_tokens=0)  # fmt: skip
    result = measure(cfg, args.warmup)
    print(f"config: {args.n_layers} layers × {args.d_model}, {args.n_heads} heads, block {args.block_size}, "
          f"batch {args.batch_size}, {'GPT block' if args.gpt else 'qkv default block'}, {args.dtype}, "
          f"{torch.get_num_threads()} threads")  # fmt: skip
    print(f"{'params':>10} {'tokens/s':>10} {'ms/step':>9} {'model TFLOP/s':>14} {'peak TFLOP/s':>13} {'MFU':>6}")
    print(f"{result.params_m:>9.2f}M {result.tokens_per_s:>10,.0f} {result.ms_per_step:>9.1f} "
          f"{result.model_tflops_per_s:>14.4f} {result.peak_tflops_per_s:>13.4f} {result.mfu:>6.1%}")  # fmt: skip
    save_report(args.json, {"config": cfg.to_dict(), "batch_size": args.batch_size, **asdict(result)})


if __name__ == "__main__":
    main()
