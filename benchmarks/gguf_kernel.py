"""qkv's GGUF kernel alone: a whole SmolLM2-135M step's weight products, per block format, against PyTorch's
group-wise int4 kernel (one plane: 4-bit codes; two planes: what wider codes took on it) in the same run.

The matrices are random blocks of SmolLM2-135M's shapes (30 layers of q, k, v, o, gate, up and down, then the
49,152-row head); the activations are one row (a decode step) or --prompt-rows rows (reading a prompt). K-quants
need K a multiple of 256, so their 576-wide matrices are Q5_0, as llama.cpp's Q4_K_M makes them.

    python benchmarks/gguf_kernel.py
    python benchmarks/gguf_kernel.py --threads 2 --repeats 20
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch

LAYER = [(576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536)]


def random_blocks(kind: str, n: int, k: int, rng: np.random.Generator) -> torch.Tensor:
    """Random bytes for an (N, K) matrix of `kind`, with finite float16 scales."""
    from qkv.quantization.ggml import BLOCKS, HALVES

    per, size = BLOCKS[kind]
    raw = rng.integers(0, 256, (n, k // per, size), dtype=np.uint8)
    for at in HALVES[kind]:
        raw[..., at : at + 2] = rng.uniform(0.001, 0.02, (n, k // per)).astype(np.float16).view(np.uint8).reshape(
            n, k // per, 2)  # fmt: skip
    return torch.from_numpy(raw.reshape(n, -1))


def timed(step: Callable[[], object], repeats: int) -> float:
    """Median seconds of one call, after a warm-up call."""
    step()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def int4_step(planes: list[tuple[torch.Tensor, torch.Tensor]], xb: dict[int, torch.Tensor], count: int) -> None:
    """Every product on PyTorch's int4 kernel, each `count` times (the planes a format takes)."""
    for p, sz in planes:
        for _ in range(count):
            torch.ops.aten._weight_int4pack_mm_for_cpu(xb[p.shape[1] * 2], p, 32, sz)


def our_step(kinds: list[str], blocks: list[torch.Tensor], xs: dict[int, torch.Tensor]) -> None:
    """Every product on qkv's kernel."""
    from qkv.quantization import BLOCKS
    from qkv.quantization.blocks import TYPE_IDS

    for kind, b in zip(kinds, blocks, strict=True):
        per, size = BLOCKS[kind]
        torch.ops.qkv.ggml_mm(xs[b.shape[1] // size * per], b, TYPE_IDS[kind])


def main() -> None:
    """Print the step's time per format and kernel, and the ratio to the int4 kernel's one plane."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--prompt-rows", type=int, default=512)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from qkv.quantization import native
    from qkv.quantization.blocks import TYPE_IDS
    from qkv.quantization.groups import _pack

    assert native.available(), "qkv's kernels did not build (see the message above)"
    shapes = LAYER * 30 + [(49152, 576)]
    rng = np.random.default_rng(0)
    planes = [(_pack(torch.randint(0, 16, s)), torch.randn(s[1] // 32, s[0], 2).bfloat16()) for s in shapes]
    formats = {}
    for kind in TYPE_IDS:
        kinds = [kind if not (kind.endswith("_K") and k % 256) else "Q5_0" for _, k in shapes]
        formats[kind] = (kinds, [random_blocks(t, n, k, rng) for t, (n, k) in zip(kinds, shapes, strict=True)])
    print(f"{'rows':>5}  {'weights':>23}  {'ms a step':>9}  vs int4 one plane")
    for rows in (1, args.prompt_rows):
        xs = {k: torch.randn(rows, k) for k in (576, 1536)}
        xb = {k: x.bfloat16() for k, x in xs.items()}
        base = timed(functools.partial(int4_step, planes, xb, 1), args.repeats)
        results = {"int4 kernel, one plane": base,
                   "int4 kernel, two planes": timed(functools.partial(int4_step, planes, xb, 2), args.repeats)}
        for kind, (kinds, blocks) in formats.items():
            results[f"qkv kernel, {kind}"] = timed(functools.partial(our_step, kinds, blocks, xs), args.repeats)
        for name, seconds in results.items():
            print(f"{rows:5d}  {name:>23}  {seconds * 1e3:9.2f}  {seconds / base:.2f}×")


if __name__ == "__main__":
    main()
