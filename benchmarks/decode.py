"""Decode speed: qkv with and without the KV cache vs transformers' generate, on the same GPT-2-124M-shaped weights.

A DecoderLM of GPT-2 small's shape (vocab 50257, 12 layers × 768, 12 heads, learned positions, LayerNorm, gelu_tanh,
tied embeddings) with random weights is exported with qkv.save_hf and loaded by transformers' GPT2LMHeadModel, so
both decode the very same weights in the same run. Greedy decoding of --new-tokens tokens after a random prompt of
--prompt-len tokens, at each batch size; tokens/s = batch × new tokens / seconds, after one short warm-up call.
Without the cache every step re-reads the whole sequence (quadratic work), so that row decodes --uncached-tokens
tokens (default 64) to keep the run short; its tokens/s is therefore measured over a shorter sequence.

At batch 1 a decode step is bound by memory, not arithmetic: every weight matrix is read once per token (GPT-2
small: 124 M fp32 numbers, 0.5 GB). The benchmark measures that bound in the same run — one token multiplied
by every weight matrix of the model (and its bias), nothing else, in the faster of the two layouts — and prints
it beside the decoders, so it tells how much of the gap to any other implementation is left to close. At batch 1
it also clocks a qkv step with hooks on every product: the time inside them, and the time outside (norms,
attention, the cache, sampling, Python), which is what keeps a decoder from the ceiling. At batch 1 in float32,
qkv decodes as `qkv generate` does, with input-major matrices (qkv.quantization.input_major).

Hence --dtypes: in bfloat16 each weight is 2 bytes instead of 4, so a decoder bound by memory runs up to 2× faster.
Both implementations are measured in every dtype, on the same weights rounded the same way; the headline ratio is
qkv in bfloat16 over transformers in float32 (its default), and the table shows transformers in bfloat16 too.
The int8 row (skip it with --no-int8) is qkv with int8 weight-only Linears (`qkv generate --quantize int8`: one
byte per weight, the tied head included; each product's input in bfloat16, everything else in float32), raced
against transformers in float32; its ceiling is the same one-token pass through the int8 kernel.
tests/test_interop_real.py checks that bfloat16 keeps a real model's greedy text (SmolLM2-135M).

    python benchmarks/decode.py                                   # batch 1 and 8, 256 new tokens, fp32 and bf16
    python benchmarks/decode.py --batch-sizes 1 --prompt-len 128 --new-tokens 128 --json decode.json

Given a MODEL (a run, a .gguf, a Hugging Face or convert directory), it measures that model alone, as `qkv generate`
runs it (a GGUF at its own precision on the CPU): prefill tok/s over a --prompt-len-token prompt of the embedded
Shakespeare, decode tok/s, time to the first token and the process's peak memory (`qkv bench decode MODEL --compile`).
"""

from __future__ import annotations

import argparse
import copy
import functools
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from qkv import DecoderLM, DecoderLMConfig
from qkv.bench import save_report
from qkv.generation import Sampling, generate
from qkv.interop import save_hf
from qkv.io import DTYPES
from qkv.quantization import InputMajorLinear, Int8Linear, input_major, quantize_int8

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
def weight_read_bound(model: nn.Module, device: torch.device, dtype: torch.dtype, repeats: int = 10) -> float:
    """Tokens/s of a step that only multiplies one token by each weight matrix once (the memory-bound ceiling)."""
    layers: dict[int, tuple[Callable[[Tensor], Tensor], int]] = {}  # each product once, with its input width
    for m in model.modules():
        if isinstance(m, nn.Linear):  # with its bias, as the other kinds' forward and the decoder's Linear add it
            layers[id(m.weight)] = functools.partial(F.linear, weight=m.weight, bias=m.bias), m.in_features
        elif isinstance(m, (Int8Linear, InputMajorLinear)):  # the same kernel a decode step calls
            layers[id(m)] = m, m.in_features
    inputs = {k: torch.randn(1, k, device=device, dtype=dtype) for _, k in layers.values()}
    best = float("inf")
    for _ in range(repeats):
        seconds, _ = _timed(lambda: torch.stack([f(inputs[k]).sum() for f, k in layers.values()]), device)
        best = min(best, seconds)
    return 1.0 / best


PRODUCTS = (nn.Linear, Int8Linear, InputMajorLinear)  # the modules whose weight reads the ceiling times


@torch.inference_mode()
def time_split(model: nn.Module, ids: Tensor, n: int, device: torch.device) -> tuple[float, float]:
    """(ms per token in all, ms per token inside the weight products) of one greedy decode of n tokens after ids.

    Forward hooks clock every product; what is left (norms, attention, the cache, sampling, Python) is the part a
    decoder adds to the ceiling's work. The hooks' own cost falls outside the products, so "outside" is an upper bound.
    """
    inside = [0.0]
    started: dict[int, float] = {}

    def before(module: nn.Module, _: Any) -> None:
        started[id(module)] = time.perf_counter()

    def after(module: nn.Module, _: Any, out: Tensor) -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()
        inside[0] += time.perf_counter() - started[id(module)]

    handles = [h for m in model.modules() if isinstance(m, PRODUCTS)
               for h in (m.register_forward_pre_hook(before), m.register_forward_hook(after))]  # fmt: skip
    try:
        decode = _qkv_decoder(model, ids)
        decode(2)
        inside[0] = 0.0
        seconds, _ = _timed(functools.partial(decode, n), device)
    finally:
        for h in handles:
            h.remove()
    return 1e3 * seconds / n, 1e3 * inside[0] / n


def _race(decoders: dict[str, Callable[[int], Tensor]], n: int, device: torch.device, repeats: int
          ) -> tuple[dict[str, float], dict[str, Tensor]]:  # fmt: skip
    """Best seconds of each decoder for n tokens, runs interleaved (a slow moment hits all alike), and outputs."""
    for decode in decoders.values():
        decode(2)  # warm-up: first-call allocations and kernel selection
    best = dict.fromkeys(decoders, float("inf"))
    outputs: dict[str, Tensor] = {}
    for _ in range(repeats):
        for name, decode in decoders.items():
            seconds, outputs[name] = _timed(functools.partial(decode, n), device)
            best[name] = min(best[name], seconds)
    return best, outputs


def _qkv_decoder(model: nn.Module, ids: Tensor, cache: bool = True) -> Callable[[int], Tensor]:
    """qkv greedy decoding of n tokens after ids."""
    return lambda n: generate(cast(DecoderLM, model), ids, n, Sampling(temperature=0.0), use_cache=cache)


def _hf_decoder(hf: Any, ids: Tensor) -> Callable[[int], Tensor]:
    """transformers greedy decoding of exactly n tokens (no eos in the config, min = max)."""
    mask = torch.ones_like(ids)
    return lambda n: hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                                 do_sample=False, use_cache=True, pad_token_id=0)  # fmt: skip


@torch.no_grad()
def measure(cfg: DecoderLMConfig, batch_sizes: list[int], prompt_len: int, new_tokens: int, uncached_tokens: int,
            device: torch.device, dtypes: list[str], repeats: int = 2, int8: bool = True
            ) -> dict[str, Any]:  # fmt: skip
    """tokens/s of qkv (cache on / off, int8) and transformers (cache on) per dtype and batch, on shared weights."""
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
        # What `qkv generate` decodes one float32 sequence on the CPU with: input-major matrices (qkv.quantization).
        transposed = input_major(copy.deepcopy(model)) if same and device.type == "cpu" else None
        bounds[dtype_name] = max(weight_read_bound(m, device, dtype) for m in (model, transposed) if m is not None)
        for batch in batch_sizes:
            ids = torch.randint(0, cfg.vocab_size, (batch, prompt_len), device=device)
            ours = transposed if transposed is not None and batch == 1 else model
            best, out = _race({"qkv": _qkv_decoder(ours, ids), "hf": _hf_decoder(hf, ids)}, new_tokens, device,
                              repeats)  # fmt: skip
            row = {"qkv_cache_tokens_per_s": batch * new_tokens / best["qkv"],
                   "transformers_tokens_per_s": batch * new_tokens / best["hf"],
                   # Same weights, both greedy: the tokens should agree (rounding may split near-ties late).
                   "same_tokens": bool(torch.equal(out["qkv"].cpu(), out["hf"].cpu()))}  # fmt: skip
            row["qkv_over_transformers"] = row["qkv_cache_tokens_per_s"] / row["transformers_tokens_per_s"]
            row["qkv_over_ceiling"] = row["qkv_cache_tokens_per_s"] / bounds[dtype_name] / batch
            row["transformers_over_ceiling"] = row["transformers_tokens_per_s"] / bounds[dtype_name] / batch
            if batch == 1:
                row["ms_per_token"], row["ms_in_products"] = time_split(ours, ids, new_tokens, device)
            if dtype_name == no_cache_dtype:  # quadratic and slow: once, in float32 if it is measured
                slow, _ = _race({"qkv": _qkv_decoder(model, ids, cache=False)}, uncached_tokens, device, 1)
                row["qkv_no_cache_tokens_per_s"] = batch * uncached_tokens / slow["qkv"]
                row["cache_speedup"] = row["qkv_cache_tokens_per_s"] / row["qkv_no_cache_tokens_per_s"]
            rows[f"{dtype_name}/{batch}"] = row
    if int8:
        rows.update(measure_int8(base, hf_base, cfg, batch_sizes, prompt_len, new_tokens, device, repeats, bounds))
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


def measure_int8(base: DecoderLM, hf_fp32: Any, cfg: DecoderLMConfig, batch_sizes: list[int], prompt_len: int,
                 new_tokens: int, device: torch.device, repeats: int, bounds: dict[str, float]
                 ) -> dict[str, Any]:  # fmt: skip
    """qkv with int8 weights (qkv.quantization; the tied head quantised too), raced against transformers fp32."""
    quantized = copy.deepcopy(base)
    quantize_int8(quantized)
    bounds["int8"] = weight_read_bound(quantized, device, torch.float32)
    rows = {}
    for batch in batch_sizes:
        ids = torch.randint(0, cfg.vocab_size, (batch, prompt_len), device=device)
        best, out = _race({"qkv": _qkv_decoder(quantized, ids), "hf": _hf_decoder(hf_fp32, ids)}, new_tokens,
                          device, repeats)  # fmt: skip
        row = {"qkv_cache_tokens_per_s": batch * new_tokens / best["qkv"],
               "transformers_tokens_per_s": batch * new_tokens / best["hf"],  # float32
               "same_tokens": bool(torch.equal(out["qkv"].cpu(), out["hf"].cpu()))}  # fmt: skip
        row["qkv_over_transformers"] = row["qkv_cache_tokens_per_s"] / row["transformers_tokens_per_s"]
        row["qkv_over_ceiling"] = row["qkv_cache_tokens_per_s"] / bounds["int8"] / batch
        if batch == 1:
            row["ms_per_token"], row["ms_in_products"] = time_split(quantized, ids, new_tokens, device)
        rows[f"int8/{batch}"] = row
    return rows


def print_table(report: dict[str, Any]) -> None:
    """One markdown row per dtype and batch size, then the headline ratio."""
    print(f"Greedy decode, {report['params_m']:.1f} M parameters, prompt {report['prompt_len']}, "
          f"{report['new_tokens']} new tokens ({report['uncached_tokens']} without the cache), "
          f"{report['device']}, {report['threads']} thread(s)")  # fmt: skip
    for dtype, bound in report["weight_read_bound_tokens_per_s"].items():
        print(f"memory-bound ceiling at batch 1, {dtype} (one token × every weight matrix): {bound:,.1f} tok/s")
    print("\n| weights | batch | qkv cache tok/s | qkv no-cache tok/s | transformers tok/s | qkv / transformers "
          "| qkv / ceiling | same tokens |\n|---|---:|---:|---:|---:|---:|---:|---|")  # fmt: skip
    for key, r in report["rows"].items():
        dtype, batch = key.split("/")
        no_cache = f"{r['qkv_no_cache_tokens_per_s']:,.1f}" if "qkv_no_cache_tokens_per_s" in r else "—"
        label = "int8 weights vs transformers fp32" if dtype == "int8" else dtype
        print(f"| {label} | {batch} | {r['qkv_cache_tokens_per_s']:,.1f} | {no_cache} | "
              f"{r['transformers_tokens_per_s']:,.1f} | {r['qkv_over_transformers']:.2f} | "
              f"{r['qkv_over_ceiling']:.0%} | {r['same_tokens']} |")  # fmt: skip
    rows = report["rows"]
    for key, r in rows.items():
        if "ms_in_products" in r:
            dtype = key.split("/")[0]
            budget = 1e3 / report["weight_read_bound_tokens_per_s"][dtype] * (1 / 0.95 - 1)
            outside = r["ms_per_token"] - r["ms_in_products"]
            print(
                f"\nqkv {dtype}, batch 1, hooks on: {r['ms_per_token']:.2f} ms per token, {r['ms_in_products']:.2f} "
                f"in the weight products, {outside:.2f} outside them (95 % of the ceiling leaves {budget:.2f} ms)"
            )
    for batch, ratio in report["qkv_bf16_over_transformers_fp32"].items():
        print(f"\nbatch {batch}: qkv in bfloat16 decodes {ratio:.2f}× as fast as transformers in float32")
        if f"int8/{batch}" in rows:
            int8 = rows[f"int8/{batch}"]["qkv_cache_tokens_per_s"]
            print(f"batch {batch}: qkv int8 decodes {rows[f'int8/{batch}']['qkv_over_transformers']:.2f}× as fast as "
                  f"transformers in float32, {int8 / rows[f'bfloat16/{batch}']['qkv_cache_tokens_per_s']:.2f}× qkv "
                  "in bfloat16")  # fmt: skip


def measure_model(path: str, prompt_len: int, new_tokens: int, compiled: bool) -> dict[str, float]:
    """One model as `qkv generate` runs it: prefill and decode tok/s, time to first token, peak memory."""
    from qkv.bench import status_bytes
    from qkv.cli.runs import native_gguf
    from qkv.evals.bpb import default_text
    from qkv.generation import GREEDY, compiled_step, stream
    from qkv.quantization import weight_bytes
    from qkv.tasks import load

    native = native_gguf(path, torch.device("cpu"))  # as `qkv generate` decides it
    begin = time.perf_counter()
    run = load(path, device="cpu", expect="lm", native=native)
    loaded = time.perf_counter() - begin
    ids = torch.tensor([run.require_tokenizer().encode(default_text())[:prompt_len]])
    for _ in stream(run.model, ids[:, :8], 4, GREEDY, compiled=compiled):  # warm-up (and compiling)
        pass
    start = time.perf_counter()
    steps = stream(run.model, ids, new_tokens, GREEDY, compiled=compiled)
    next(steps)
    first = time.perf_counter()
    count = sum(1 for _ in steps)
    end = time.perf_counter()
    return {"load_s": loaded, "prompt_tokens": ids.shape[1], "prefill_tok_s": ids.shape[1] / (first - start),
            "ttft_ms": 1e3 * (first - start), "decode_tok_s": count / (end - first),
            "peak_rss_mib": status_bytes("VmHWM") / 2**20, "weight_mb": weight_bytes(run.model) / 1e6,
            "compile_s": (compiled_step(run.model).compile_s or 0.0) if compiled else 0.0}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    """Parse options, measure, print the table, optionally write JSON."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", nargs="?", metavar="MODEL", help="measure this model alone (see above)")
    p.add_argument("--compile", action="store_true", help="MODEL: the one-token step compiled (qkv generate --compile)")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    p.add_argument("--prompt-len", type=int, help="prompt tokens (default 16; with MODEL 512)")
    p.add_argument("--new-tokens", type=int, help="new tokens (default 256; with MODEL 128)")
    p.add_argument("--uncached-tokens", type=int, default=64, help="new tokens for the no-cache row (slow)")
    p.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch intra-op threads")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--repeats", type=int, default=2, help="timed runs of each decoder, interleaved; the best counts")
    p.add_argument("--dtypes", nargs="+", choices=DTYPES, default=["float32", "bfloat16"])
    p.add_argument("--no-int8", action="store_true", help="skip the int8 weight-only row")
    # Smaller shapes for smoke tests; the defaults are GPT-2 small.
    p.add_argument("--n-layers", type=int, default=GPT2_SMALL["n_layers"])
    p.add_argument("--d-model", type=int, default=GPT2_SMALL["d_model"])
    p.add_argument("--n-heads", type=int, default=GPT2_SMALL["n_heads"])
    p.add_argument("--vocab-size", type=int, default=GPT2_SMALL["vocab_size"])
    p.add_argument("--json", help="also write the results to this file")
    args = p.parse_args(argv)
    args.prompt_len = args.prompt_len or (512 if args.model else 16)
    args.new_tokens = args.new_tokens or (128 if args.model else 256)
    if min(args.new_tokens, args.uncached_tokens, args.prompt_len, args.repeats, *args.batch_sizes) < 1:
        p.error("batch sizes, --prompt-len, --new-tokens, --uncached-tokens and --repeats must be ≥ 1")
    if args.prompt_len + max(args.new_tokens, args.uncached_tokens) > GPT2_SMALL["max_positions"]:
        p.error(f"prompt + new tokens must fit GPT-2's {GPT2_SMALL['max_positions']} positions")
    torch.set_num_threads(args.threads)
    if args.model:
        result = measure_model(args.model, args.prompt_len, args.new_tokens, args.compile)
        print(f"{args.model}: prefill {result['prefill_tok_s']:.1f} tok/s ({result['prompt_tokens']} tokens), decode "
              f"{result['decode_tok_s']:.1f} tok/s, first token {result['ttft_ms']:.0f} ms, peak memory "
              f"{result['peak_rss_mib']:.0f} MiB, {result['weight_mb']:.1f} MB of weights read per token"
              + (f", compiled step's first call {result['compile_s']:.1f} s" if args.compile else ""))  # fmt: skip
        save_report(args.json, result)
        return 0
    shape = {"n_layers": args.n_layers, "d_model": args.d_model, "n_heads": args.n_heads, "vocab_size": args.vocab_size}
    cfg = DecoderLMConfig.of(**{**GPT2_SMALL, **shape})
    report = measure(cfg, args.batch_sizes, args.prompt_len, args.new_tokens, args.uncached_tokens,
                     torch.device(args.device), args.dtypes, args.repeats, not args.no_int8)  # fmt: skip
    print_table(report)
    save_report(args.json, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
