"""Dropout on the CPU: torch's nn.Dropout against qkv's (four masks per 64-bit random draw).

Two measurements, each as a ratio taken in the same run, cases interleaved, best of --repeats:
1. forward + backward of dropout alone on an (N, d) activation, with a matmul of the same tensor for scale;
2. one training step of the default translation model (2 + 2 layers, d_model 128, dropout 0.1) on real
   ~1,500-token batches, with every qkv Dropout swapped for nn.Dropout, and with dropout 0 as the floor.

    python benchmarks/dropout.py              # or: qkv bench dropout
    python benchmarks/dropout.py --rows 3000 --width 512 --steps 20 --repeats 3 --json dropout.json
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from qkv.bench import save_report
from qkv.blocks.dropout import Dropout, dropout


def best_ms(fn: Callable[[], Any], n: int, repeats: int) -> float:
    """Best of `repeats` means over n calls, in milliseconds (after 3 warm-up calls)."""
    for _ in range(3):
        fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter() - start) / n * 1e3)
    return best


def kernel_times(rows: int, width: int, p: float, repeats: int) -> dict[str, float]:
    """ms for forward + backward of each dropout on a (rows, width) tensor, and for x @ W (width × width)."""
    x = torch.randn(rows, width, requires_grad=True)
    w = torch.randn(width, width)
    grad = torch.ones(rows, width)

    def step(fn: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[], None]:
        return lambda: fn(x).backward(grad)

    return {
        "matmul_ms": best_ms(lambda: x.detach() @ w, 20, repeats),
        "torch_ms": best_ms(step(lambda t: F.dropout(t, p, True)), 20, repeats),
        "qkv_ms": best_ms(step(lambda t: dropout(t, p, True)), 20, repeats),
    }


def with_torch_dropout(model: nn.Module) -> nn.Module:
    """The model with every qkv Dropout replaced by nn.Dropout of the same p."""
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, Dropout):
                setattr(module, name, nn.Dropout(child.p))
    return model


def step_times(steps: int, repeats: int) -> dict[str, float]:
    """ms per training step of the default translation model, three ways, on the same batches."""
    from qkv.config import TransformerConfig
    from qkv.models import Transformer
    from qkv.training.common import make_optimizer
    from qkv.translation.batching import length_buckets, make_batch
    from qkv.translation.config import DEFAULT_MODEL, TranslateConfig
    from qkv.translation.corpus import split_de_en
    from qkv.translation.run import specials_of, train_tokenizer
    from qkv.translation.step import train_step
    from qkv.translation.trainer import encode_pairs

    cfg = TranslateConfig()
    splits = split_de_en()
    tokenizer = train_tokenizer([s for pair in splits.train for s in pair], cfg.vocab_size)
    sp = specials_of(tokenizer)
    pairs = encode_pairs(tokenizer, splits.train, 1024)
    buckets = length_buckets(pairs, cfg.batch_tokens)
    gen = torch.Generator().manual_seed(0)
    picks = [buckets[int(torch.randint(len(buckets), (1,), generator=gen))] for _ in range(steps)]
    batches = [make_batch([pairs[i][0] for i in b], [pairs[i][1] for i in b], sp) for b in picks]
    models = {}
    for name, drop in (("torch", 0.1), ("qkv", 0.1), ("none", 0.0)):
        torch.manual_seed(0)
        fields = {**DEFAULT_MODEL, "dropout": drop}
        model_cfg = TransformerConfig(src_vocab_size=tokenizer.vocab_size, tgt_vocab_size=tokenizer.vocab_size,
                                      share_embeddings=True, pad_id=sp.pad, **fields)  # fmt: skip
        model = Transformer(model_cfg)
        models[name] = (with_torch_dropout(model) if name == "torch" else model, make_optimizer(model, cfg))
    best = {name: float("inf") for name in models}
    for _ in range(repeats):  # interleaved, so drifting machine load hits every case alike
        for name, (model, optimizer) in models.items():
            model.train()
            start = time.perf_counter()
            for batch in batches:
                train_step(model, optimizer, batch, cfg.label_smoothing, cfg.grad_clip)
            best[name] = min(best[name], (time.perf_counter() - start) / len(batches) * 1e3)
    return {f"step_{name}_ms": ms for name, ms in best.items()}


def main(argv: list[str] | None = None) -> int:
    """Print both tables; optionally save the figures as JSON."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=3000)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--p", type=float, default=0.1)
    parser.add_argument("--steps", type=int, default=20, help="training steps per case and repeat")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args(argv)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    k = kernel_times(args.rows, args.width, args.p, args.repeats)
    print(f"\ndropout p={args.p} on ({args.rows}, {args.width}), forward + backward, best of {args.repeats}:")
    print(f"  x @ W ({args.width}²), for scale   {k['matmul_ms']:7.2f} ms")
    print(f"  torch nn.Dropout                {k['torch_ms']:7.2f} ms")
    print(f"  qkv Dropout                     {k['qkv_ms']:7.2f} ms   ({k['torch_ms'] / k['qkv_ms']:.2f}× faster)")
    s = step_times(args.steps, args.repeats)
    print(f"\ntranslation training step (default model), best of {args.repeats} × {args.steps} steps:")
    print(f"  torch nn.Dropout 0.1            {s['step_torch_ms']:7.1f} ms")
    print(f"  qkv Dropout 0.1                 {s['step_qkv_ms']:7.1f} ms   "
          f"({s['step_torch_ms'] / s['step_qkv_ms']:.2f}× faster)")  # fmt: skip
    print(f"  no dropout (the floor)          {s['step_none_ms']:7.1f} ms")
    overhead_torch, overhead_qkv = s["step_torch_ms"] - s["step_none_ms"], s["step_qkv_ms"] - s["step_none_ms"]
    print(f"  dropout's cost per step: torch {overhead_torch:.1f} ms, qkv {overhead_qkv:.1f} ms")
    if args.json:
        save_report(args.json, {"args": vars(args), **k, **s})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
