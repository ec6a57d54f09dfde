"""Attention forward + backward: qkv's reference path vs its fused path vs plain torch SDPA — time and peak memory.

Causal self-attention, batch 1, 8 heads of 64, fp32 (or --dtype), at each sequence length T. Peak memory is the extra
memory a forward + backward needs beyond its inputs (q, k, v and the output gradient):
- on CUDA, torch.cuda.max_memory_allocated after reset_peak_memory_stats, minus the memory allocated by then;
- on CPU, each case runs in a forked child process: the kernel's peak resident set (VmHWM) after the step minus the
  resident set once the inputs exist. Before that baseline the child hands freed heap pages back to the OS
  (malloc_trim) and restarts the peak mark at the current size (/proc/self/clear_refs): otherwise the step could
  reuse pages the parent had freed but kept resident, and its memory would not show.
The reference path materialises (T × T) scores and weights per head, so its memory grows ~16× when T grows 4×; the
fused kernels keep it linear (~4×). The table prints mem(T) / mem(T/4) for each path; the reference path is skipped
where its (H, T, T) weights alone would exceed --ref-cap-mib. --kernel flash restricts PyTorch's SDPA to its flash
kernel (fp16/bf16 on a GPU): a case it cannot serve fails instead of quietly taking another kernel.

    python benchmarks/attention.py                               # T = 128 512 2048 8192
    python benchmarks/attention.py --seq-lens 256 1024 --repeats 3 --json attention.json
    python benchmarks/attention.py --device cuda --dtype bfloat16 --kernel flash --seq-lens 8192 32768 \
        --ref-cap-mib 4096                                       # flash attention on a GPU
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from qkv.attention.sdpa import scaled_dot_product_attention
from qkv.bench import reset_peak_rss, save_report, status_bytes
from qkv.io import DTYPES

HEADS, D_HEAD = 8, 64
PATHS = ("reference", "fused", "torch")
KERNELS = ("auto", "flash", "efficient", "math")  # torch.nn.attention.SDPBackend's, for the SDPA paths


def _kernel(path: str, kernel: str) -> contextlib.AbstractContextManager[Any]:
    """PyTorch's SDPA restricted to one kernel (the SDPA paths only; the reference path calls none)."""
    if kernel == "auto" or path == "reference":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
               "math": SDPBackend.MATH}[kernel]  # fmt: skip
    return sdpa_kernel(backend)


def _attend(path: str) -> Callable[[Tensor, Tensor, Tensor], Tensor]:
    """The attention function for one path (all causal)."""
    if path == "torch":
        return lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True)
    backend: Any = path  # "reference" | "fused"
    return lambda q, k, v: scaled_dot_product_attention(q, k, v, causal=True, backend=backend)


def _inputs(t: int, device: str, dtype: str = "float32") -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """q, k, v (1, H, T, d) requiring grad, and an output gradient of the same shape."""
    gen = torch.Generator().manual_seed(0)
    q, k, v, g = (torch.randn(1, HEADS, t, D_HEAD, generator=gen).to(device, getattr(torch, dtype)) for _ in range(4))
    return q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), g


def _step(fn: Callable[[Tensor, Tensor, Tensor], Tensor], q: Tensor, k: Tensor, v: Tensor, g: Tensor) -> None:
    """One forward + backward; gradients dropped afterwards so every step allocates the same."""
    fn(q, k, v).backward(g)
    q.grad = k.grad = v.grad = None


def _sync(device: str) -> None:
    """Wait for queued GPU work, so wall-clock times cover it."""
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def measure_case(path: str, t: int, device: str, repeats: int, threads: int, dtype: str = "float32",
                 kernel: str = "auto") -> dict[str, float]:  # fmt: skip
    """ms (median of `repeats` forward + backward) and peak extra memory (MiB) of one path at one T, in-process."""
    with _kernel(path, kernel):
        return _measure(path, t, device, repeats, threads, dtype)


def _measure(path: str, t: int, device: str, repeats: int, threads: int, dtype: str) -> dict[str, float]:
    """measure_case's body, under whatever SDPA kernel restriction it set."""
    torch.set_num_threads(threads)
    fn = _attend(path)
    small = _inputs(16, device, dtype)
    _step(fn, *small)  # page in kernels and start thread pools before the baseline, so they do not count
    del small
    q, k, v, g = _inputs(t, device, dtype)
    if device.startswith("cuda"):
        _sync(device)
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        _step(fn, q, k, v, g)
        _sync(device)
        peak = torch.cuda.max_memory_allocated() - base
    else:
        base = reset_peak_rss()
        _step(fn, q, k, v, g)  # the first step after the baseline sets the peak; later ones reuse freed memory
        peak = status_bytes("VmHWM") - base
    times = []
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        _step(fn, q, k, v, g)
        _sync(device)
        times.append(time.perf_counter() - start)
    return {"ms": statistics.median(times) * 1000, "peak_mib": peak / 2**20}


def _child(conn: Any, path: str, t: int, device: str, repeats: int, threads: int, dtype: str, kernel: str) -> None:
    """Forked-process body: measure one case and send the result (or the error) back."""
    try:
        conn.send(measure_case(path, t, device, repeats, threads, dtype, kernel))
    except BaseException as e:  # report any failure (even MemoryError) to the parent instead of dying silently
        conn.send({"error": f"{type(e).__name__}: {e}"})
    finally:
        conn.close()


def run_case(path: str, t: int, device: str, repeats: int, threads: int, dtype: str = "float32",
             kernel: str = "auto") -> dict[str, Any]:  # fmt: skip
    """measure_case in a forked child on CPU (a clean peak-RSS baseline); in-process on CUDA, errors reported."""
    if device.startswith("cuda"):
        try:
            return measure_case(path, t, device, repeats, threads, dtype, kernel)
        except RuntimeError as e:  # no such kernel for these inputs, or out of memory (a RuntimeError too)
            torch.cuda.empty_cache()
            return {"error": f"{type(e).__name__}: {str(e).splitlines()[0]}"}
    ctx = multiprocessing.get_context("fork")
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child, args=(child, path, t, device, repeats, threads, dtype, kernel))
    proc.start()
    child.close()
    try:
        result: dict[str, Any] = parent.recv()
    except EOFError:  # killed without a word, e.g. by the OOM killer
        result = {"error": "the child process died"}
    proc.join()
    return result


def ref_weights_mib(t: int, dtype: str = "float32") -> float:
    """Size of the reference path's (1, H, T, T) attention weights, the largest tensor it makes."""
    return HEADS * t * t * getattr(torch, dtype).itemsize / 2**20


def run(seq_lens: list[int], paths: list[str], device: str, repeats: int, threads: int, ref_cap_mib: float,
        dtype: str = "float32", kernel: str = "auto") -> dict[str, Any]:  # fmt: skip
    """Every (path, T) case; skipped reference cases say why; mem(T)/mem(T/4) ratios where T/4 was measured."""
    results: dict[str, dict[int, dict[str, Any]]] = {p: {} for p in paths}
    for t in seq_lens:
        for path in paths:
            size = ref_weights_mib(t, dtype)
            if path == "reference" and size > ref_cap_mib:
                results[path][t] = {"skipped": f"T×T weights {size:,.0f} MiB > cap {ref_cap_mib:g} MiB"}
                continue
            results[path][t] = run_case(path, t, device, repeats, threads, dtype, kernel)
    for row in results.values():
        for t, case in row.items():
            lower = row.get(t // 4, {}) if t % 4 == 0 else {}
            if "peak_mib" in case and lower.get("peak_mib", 0) > 0:
                case["mem_ratio_vs_T/4"] = case["peak_mib"] / lower["peak_mib"]
    return {
        "device": device, "threads": threads, "batch": 1, "heads": HEADS, "d_head": D_HEAD, "dtype": dtype,
        "kernel": kernel, "causal": True,
        "memory": "cuda max_memory_allocated" if device.startswith("cuda") else "forked VmHWM",
        "results": {p: {str(t): case for t, case in row.items()} for p, row in results.items()},
    }  # fmt: skip


def print_table(report: dict[str, Any]) -> None:
    """One markdown row per (path, T): ms, peak MiB, ratio to T/4 and its reading (~4× linear, ~16× quadratic)."""
    print(f"Attention forward + backward, causal, batch 1, {HEADS} heads × {D_HEAD}, {report['dtype']}, "
          f"SDPA kernel {report.get('kernel', 'auto')}, {report['device']}, "
          f"{report['threads']} thread(s); peak = extra memory beyond the inputs ({report['memory']})\n")  # fmt: skip
    print("| path | T | ms | peak MiB | mem(T) / mem(T/4) | growth |\n|---|---:|---:|---:|---:|---|")
    for path, row in report["results"].items():
        for t, case in row.items():
            if "skipped" in case or "error" in case:
                print(f"| {path} | {int(t):,} | — | — | — | {case.get('skipped') or case['error']} |")
                continue
            ratio = case.get("mem_ratio_vs_T/4")
            growth = "—" if ratio is None else "quadratic" if ratio > 8 else "linear" if ratio < 6 else "in between"
            shown = "—" if ratio is None else f"{ratio:.1f}×"
            print(f"| {path} | {int(t):,} | {case['ms']:.2f} | {case['peak_mib']:.1f} | {shown} | {growth} |")


def main(argv: list[str] | None = None) -> int:
    """Parse options, run every case, print the table, optionally write JSON."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq-lens", type=int, nargs="+", default=[128, 512, 2048, 8192])
    p.add_argument("--paths", nargs="+", choices=PATHS, default=list(PATHS))
    p.add_argument("--repeats", type=int, default=5, help="timed forward + backward passes per case (median)")
    p.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch intra-op threads")
    p.add_argument("--ref-cap-mib", type=float, default=1024.0,
                   help="skip the reference path where its T×T weights exceed this many MiB")  # fmt: skip
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=DTYPES, default="float32")
    p.add_argument("--kernel", choices=KERNELS, default="auto", help="restrict the SDPA paths to this kernel")
    p.add_argument("--json", help="also write the results to this file")
    args = p.parse_args(argv)
    if not sys.platform.startswith("linux") and not args.device.startswith("cuda"):
        p.error("CPU peak memory is read from a forked child's /proc/self/status, which needs Linux")
    report = run(args.seq_lens, args.paths, args.device, args.repeats, args.threads, args.ref_cap_mib, args.dtype,
                 args.kernel)  # fmt: skip
    print_table(report)
    save_report(args.json, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
