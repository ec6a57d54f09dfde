"""Decode speed: qkv with and without the KV cache vs transformers' generate, on the same GPT-2-124M-shaped weights.

A DecoderLM of GPT-2 small's shape (vocab 50257, 12 layers × 768, 12 heads, learned positions, LayerNorm, gelu_tanh,
tied embeddings) with random weights is exported with qkv.save_hf and loaded by transformers' GPT2LMHeadModel, so
both decode the very same weights in the same run. Greedy decoding of --new-tokens tokens after a random prompt of
--prompt-len tokens, at each batch size; tokens/s = batch × new tokens / seconds, after one short warm-up call.
Without the cache every step re-reads the whole sequence (quadratic work), so that row decodes --uncached-tokens
tokens (default 64) to keep the run short; its tokens/s is therefore measured over a shorter sequence.

At batch 1 a decode step is bound by memory, not arithmetic: every weight matrix is read once per token (GPT-2
small: 124 M fp32 numbers, 0.5 GB). The benchmark measures that bound in the same run — one token multiplied
by every weight matrix of the model, nothing else — and prints it beside the decoders: no fp32 decoder on this
machine can beat it, so it tells how much of the gap to any other implementation is left to close.

Hence --dtypes: in bfloat16 each weight is 2 bytes instead of 4, so a decoder bound by memory runs up to 2× faster.
Both implementations are measured in every dtype, on the same weights rounded the same way; the headline ratio is
qkv in bfloat16 over transformers in float32 (its default), and the table shows transformers in bfloat16 too.
tests/test_interop_real.py checks that bfloat16 keeps a real model's greedy text (SmolLM2-135M).

    python benchmarks/decode.py                                   # batch 1 and 8, 256 new tokens, fp32 and bf16
    python benchmarks/decode.py --batch-sizes 1 --prompt-len 128 --new-tokens 128 --json decode.json
"""

from __future__ import annotations

import argparse
import copy
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from qkv import DecoderLM, DecoderLMConfig
from qkv.bench import save_report
from qkv.generation import Sampling, generate
from qkv.interop import save_hf
from qkv.io import DTYPES

GPT2_SMALL: dict[str, Any] = {
    "vocab_size": 50257, "n_layers": 12, "d_model": 768, "n_heads": 12, "max_positions": 1024,
    "positions": "learned", "norm": "layer", "norm_placement": "pre", "activation": "gelu_tanh", "bias": True,
    "tie_embeddings": True, "dropout": 0.0,
}  # fmt: skip


def _timed(fn: Callable[[], Tensor], device: torch.device) -> tuple[float, Tensor]:
    """(seconds, result) of one call, GPU work included."""
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    out = fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start, out


@torch.inference_mode()
def weight_read_bound(model: nn.Module, device: torch.device, repeats: int = 10) -> float:
    """Tokens/s of a step that only multiplies one token by each weight matrix once (the memory-bound ceiling)."""
    weights = {id(m.weight): m.weight for m in model.modules() if isinstance(m, nn.Linear)}  # a tied head once
    inputs = {w.shape[1]: torch.randn(1, w.shape[1], device=device, dtype=w.dtype) for w in weights.values()}
    best = float("inf")
    for _ in range(repeats):
        seconds, _ = _timed(lambda: torch.stack([F.linear(inputs[w.shape[1]], w).sum() for w in weights.values()]),
                            device)  # fmt: skip
        best = min(best, seconds)
    return 1.0 / best


@torch.no_grad()
def measure(cfg: DecoderLMConfig, batch_sizes: list[int], prompt_len: int, new_tokens: int, uncached_tokens: int,
            device: torch.device, dtypes: list[str], repeats: int = 2) -> dict[str, Any]:  # fmt: skip
    """tokens/s of qkv (cache on / off) and transformers (cache on) per dtype and batch size, on shared weights."""
    from transformers import GPT2LMHeadModel  # lazy: a heavy import, needed only here
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # the weight-loading bar would interleave with the table

    torch.manual_seed(0)
    base = DecoderLM(cfg).eval().to(device)
    with tempfile.TemporaryDirectory() as tmp:
        save_hf(base, tmp)
        hf_base = GPT2LMHeadModel.from_pretrained(tmp).eval().to(device)
    rows: dict[str, Any] = {}
    bounds: dict[str, float] = {}
    no_cache_dtype = "float32" if "float32" in dtypes else dtypes[0]
    for dtype_name in dtypes:
        dtype = getattr(torch, dtype_name)
        same = dtype == torch.float32  # the float32 originals serve as they are; other dtypes get cast copies
        model, hf = (base, hf_base) if same else (copy.deepcopy(base).to(dtype), copy.deepcopy(hf_base).to(dtype))
        bounds[dtype_name] = weight_read_bound(model, device)
        for batch in batch_sizes:
            ids = torch.randint(0, cfg.vocab_size, (batch, prompt_len), device=device)
            mask = torch.ones_like(ids)

            def qkv(n: int, cache: bool, ids: Tensor = ids, model: DecoderLM = model) -> Tensor:
                """qkv greedy decoding of n tokens."""
                return generate(model, ids, n, Sampling(temperature=0.0), use_cache=cache)

            def hf_generate(n: int, ids: Tensor = ids, mask: Tensor = mask, hf: Any = hf) -> Tensor:
                """transformers greedy decoding of exactly n tokens (no eos in the config, min = max)."""
                out: Tensor = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                                          do_sample=False, use_cache=True, pad_token_id=0)  # fmt: skip
                return out

            qkv(2, True), hf_generate(2)  # warm-up: first-call allocations and kernel selection
            # Interleaved repeats, best of each: a shared machine's slow moments hit both sides alike.
            s_cached = s_hf = float("inf")
            for _ in range(repeats):
                seconds, out_qkv = _timed(lambda: qkv(new_tokens, True), device)
                s_cached = min(s_cached, seconds)
                seconds, out_hf = _timed(lambda: hf_generate(new_tokens), device)
                s_hf = min(s_hf, seconds)
            row = {"qkv_cache_tokens_per_s": batch * new_tokens / s_cached,
                   "transformers_tokens_per_s": batch * new_tokens / s_hf,
                   # Same weights, both greedy: the tokens should agree (rounding may split near-ties late).
                   "same_tokens": bool(torch.equal(out_qkv.cpu(), out_hf.cpu()))}  # fmt: skip
            row["qkv_over_transformers"] = row["qkv_cache_tokens_per_s"] / row["transformers_tokens_per_s"]
            if dtype_name == no_cache_dtype:  # quadratic and slow: once, in float32 if it is measured
                qkv(2, False)
                s_uncached, _ = _timed(lambda: qkv(uncached_tokens, False), device)
                row["qkv_no_cache_tokens_per_s"] = batch * uncached_tokens / s_uncached
                row["cache_speedup"] = row["qkv_cache_tokens_per_s"] / row["qkv_no_cache_tokens_per_s"]
            rows[f"{dtype_name}/{batch}"] = row
    headline = {}
    for batch in batch_sizes:
        fp32 = rows.get(f"float32/{batch}")
        if fp32 is not None and "bfloat16" in dtypes:
            headline[str(batch)] = (
                rows[f"bfloat16/{batch}"]["qkv_cache_tokens_per_s"] / fp32["transformers_tokens_per_s"]
            )
    return {"config": cfg.to_dict(), "weight_read_bound_tokens_per_s": bounds,
            "qkv_bf16_over_transformers_fp32": headline, "prompt_len": prompt_len, "new_tokens": new_tokens,
            "uncached_tokens": uncached_tokens, "repeats": repeats, "device": str(device),
            "threads": torch.get_num_threads(), "params_m": sum(p.numel() for p in base.parameters()) / 1e6,
            "rows": rows}  # fmt: skip


def print_table(report: dict[str, Any]) -> None:
    """One markdown row per dtype and batch size, then the headline ratio."""
    print(f"Greedy decode, {report['params_m']:.1f} M parameters, prompt {report['prompt_len']}, "
          f"{report['new_tokens']} new tokens ({report['uncached_tokens']} without the cache), "
          f"{report['device']}, {report['threads']} thread(s)")  # fmt: skip
    for dtype, bound in report["weight_read_bound_tokens_per_s"].items():
        print(f"memory-bound ceiling at batch 1, {dtype} (one token × every weight matrix): {bound:,.1f} tok/s")
    print("\n| dtype | batch | qkv cache tok/s | qkv no-cache tok/s | transformers tok/s | qkv / transformers "
          "| same tokens |\n|---|---:|---:|---:|---:|---:|---|")  # fmt: skip
    for key, r in report["rows"].items():
        dtype, batch = key.split("/")
        no_cache = f"{r['qkv_no_cache_tokens_per_s']:,.1f}" if "qkv_no_cache_tokens_per_s" in r else "—"
        print(
            f"| {dtype} | {batch} | {r['qkv_cache_tokens_per_s']:,.1f} | {no_cache} | "
            f"{r['transformers_tokens_per_s']:,.1f} | {r['qkv_over_transformers']:.2f} | {r['same_tokens']} |"
        )
    for batch, ratio in report["qkv_bf16_over_transformers_fp32"].items():
        print(f"\nbatch {batch}: qkv in bfloat16 decodes {ratio:.2f}× as fast as transformers in float32")


def main(argv: list[str] | None = None) -> int:
    """Parse options, measure, print the table, optionally write JSON."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--uncached-tokens", type=int, default=64, help="new tokens for the no-cache row (slow)")
    p.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch intra-op threads")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--repeats", type=int, default=2, help="timed runs of each decoder, interleaved; the best counts")
    p.add_argument("--dtypes", nargs="+", choices=DTYPES, default=["float32", "bfloat16"])
    # Smaller shapes for smoke tests; the defaults are GPT-2 small.
    p.add_argument("--n-layers", type=int, default=GPT2_SMALL["n_layers"])
    p.add_argument("--d-model", type=int, default=GPT2_SMALL["d_model"])
    p.add_argument("--n-heads", type=int, default=GPT2_SMALL["n_heads"])
    p.add_argument("--vocab-size", type=int, default=GPT2_SMALL["vocab_size"])
    p.add_argument("--json", help="also write the results to this file")
    args = p.parse_args(argv)
    if min(args.new_tokens, args.uncached_tokens, args.prompt_len, args.repeats, *args.batch_sizes) < 1:
        p.error("batch sizes, --prompt-len, --new-tokens, --uncached-tokens and --repeats must be ≥ 1")
    if args.prompt_len + max(args.new_tokens, args.uncached_tokens) > GPT2_SMALL["max_positions"]:
        p.error(f"prompt + new tokens must fit GPT-2's {GPT2_SMALL['max_positions']} positions")
    torch.set_num_threads(args.threads)
    shape = {"n_layers": args.n_layers, "d_model": args.d_model, "n_heads": args.n_heads, "vocab_size": args.vocab_size}
    cfg = DecoderLMConfig(**{**GPT2_SMALL, **shape})
    report = measure(cfg, args.batch_sizes, args.prompt_len, args.new_tokens, args.uncached_tokens,
                     torch.device(args.device), args.dtypes, args.repeats)  # fmt: skip
    print_table(report)
    save_report(args.json, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
