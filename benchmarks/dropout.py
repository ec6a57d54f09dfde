"""Dropout on the CPU: torch's nn.Dropout against qkv's (four masks per 64-bit random draw).

Two measurements, each as a ratio taken in the same run, cases interleaved, best of --repeats:
1. forward + backward of dropout alone on an (N, d) activation, with a matmul of the same tensor for scale;
2. one training step of the default translation model (2 + 2 layers, d_model 128, dropout 0.1) on real
   ~1,500-token batches, through `qkv train translate`'s own loop (its timing hooks), with every qkv
   Dropout swapped for nn.Dropout, and with dropout 0 as the floor.

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
from qkv.tasks import recipe, train
from qkv.training import Hooks, StepInfo


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


def with_torch_dropout(model: nn.Module) -> None:
    """Replace every qkv Dropout in the model by nn.Dropout of the same p."""
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, Dropout):
                setattr(module, name, nn.Dropout(child.p))


def step_times(steps: int, repeats: int) -> dict[str, float]:
    """ms per training step of the default translation model, three ways, through `qkv train translate`'s loop.

    Every case trains the same steps on the same batches (the same seed); the loop's on_step hook times them,
    and its on_model hook swaps qkv's Dropout for nn.Dropout in the "torch" case.
    """
    cases = {"torch": (with_torch_dropout, 0.1), "qkv": (None, 0.1), "none": (None, 0.0)}
    best = {name: float("inf") for name in cases}
    for _ in range(repeats):  # interleaved, so drifting machine load hits every case alike
        for name, (swap, p) in cases.items():
            times: list[StepInfo] = []
            cfg = recipe("translate", {"model": {"dropout": p, "attention_dropout": 0.0}, "max_steps": steps,
                                       "warmup_steps": 0, "max_time": None})  # fmt: skip
            train(cfg, verbose=False, hooks=Hooks(on_model=swap, on_step=times.append, evaluate=False))
            best[name] = min(best[name], sum(t.seconds for t in times) / len(times) * 1e3)
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
