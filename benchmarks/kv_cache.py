"""KV-cache size and decode speed: multi-head, grouped-query, multi-query and multi-head latent attention.

1. Bytes per token per layer, measured from the real cache tensors: decode N tokens one at a time through a
   1-layer DecoderLM, then divide the cache's nbytes() (KVCache or LatentKVCache) by N. All four share
   d_model 1024 and 16 query heads of 64; GQA has 4 K/V heads, MQA 1, MLA caches a kv_lora_rank 256 latent
   plus 32 RoPE dims (DeepSeek-V2's proportions: d_c = 4 · d_h, d_r = d_h / 2).
2. Decode tokens/s (batch 1) of a 2-layer model of that shape at contexts of 512, 2k and 8k tokens: MHA, MLA
   decompressing K and V from the latent every step (naive), and MLA with W_UK/W_UV absorbed. The cache is
   filled with random entries of the right shape instead of a real prefill (the time of a decode step does not
   depend on the values), so the run stays short; each figure is the median of a few timed steps.

    python benchmarks/kv_cache.py                    # both tables (about a minute on 2 CPU cores)
    python benchmarks/kv_cache.py --contexts 512 2048 --steps 3 --json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import torch

from qkv.attention import LatentAttentionConfig, set_absorb
from qkv.models import DecoderLM, DecoderLMConfig

SHAPE: dict[str, Any] = {"d_model": 1024, "n_heads": 16, "positions": "rotary", "norm": "rms",
                         "activation": "swiglu", "bias": False, "vocab_size": 256}  # fmt: skip
KINDS: dict[str, dict[str, Any]] = {
    "MHA": {},
    "GQA": {"n_kv_heads": 4},
    "MQA": {"n_kv_heads": 1},
    "MLA": {"attention": "mla", "kv_lora_rank": 256, "qk_rope_head_dim": 32},  # qk_nope = v = 64 (d_head)
}


def _model(kind: str, n_layers: int, max_positions: int, **extra: Any) -> DecoderLM:
    """An eval-mode DecoderLM of the benchmark shape with the attention `kind`."""
    cfg = DecoderLMConfig.of(**SHAPE, **KINDS[kind], **extra, n_layers=n_layers, max_positions=max_positions)
    return DecoderLM(cfg).eval()


@torch.no_grad()
def cache_bytes_per_token(n_tokens: int = 32) -> dict[str, int]:
    """Cache bytes per token per layer of each attention kind, from nbytes() after decoding n_tokens one by one."""
    sizes = {}
    for kind in KINDS:
        model = _model(kind, n_layers=1, max_positions=n_tokens, d_ff=64)  # the FFN does not touch the cache
        cache = model.new_cache(capacity=n_tokens)
        ids = torch.randint(0, SHAPE["vocab_size"], (1, n_tokens))
        for t in range(n_tokens):
            model(ids[:, t : t + 1], cache=cache)
        total = sum(layer.self_attn.nbytes() for layer in cache)
        sizes[kind] = total // (n_tokens * len(cache))
    return sizes


@torch.no_grad()
def _fill(model: DecoderLM, context: int, steps: int) -> list[Any]:
    """A cache already holding `context` random tokens per layer, with room for `steps` more."""
    cache = model.new_cache(capacity=context + steps)
    attention, d_model = model.cfg.decoder.block.attention, model.cfg.d_model
    for layer in cache:
        if isinstance(attention, LatentAttentionConfig):
            kv_lora_rank, _, rope_dim, _ = attention.sizes(d_model)
            layer.self_attn.append(torch.randn(1, 1, context, kv_lora_rank), torch.randn(1, 1, context, rope_dim))
        else:
            n_kv, d_head = getattr(attention, "n_kv_heads", None) or attention.n_heads, attention.head_dim(d_model)
            layer.self_attn.append(torch.randn(1, n_kv, context, d_head), torch.randn(1, n_kv, context, d_head))
    return cache


@torch.no_grad()
def decode_tokens_per_s(kind: str, context: int, absorb: bool = False, steps: int = 5, warmup: int = 1) -> float:
    """Decode speed (tokens/s, batch 1) of a 2-layer model with `context` tokens already cached."""
    model = _model(kind, n_layers=2, max_positions=context + warmup + steps)
    set_absorb(model, absorb)
    cache = _fill(model, context, warmup + steps)
    token = torch.zeros(1, 1, dtype=torch.long)
    times = []
    for i in range(warmup + steps):
        start = time.perf_counter()
        token = model(token, cache=cache)[:, -1:].argmax(dim=-1)
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return 1.0 / statistics.median(times)


def main(argv: list[str] | None = None) -> None:
    """Print the bytes-per-token table and the decode-speed table (markdown), or JSON with --json."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[512, 2048, 8192])
    parser.add_argument("--steps", type=int, default=5, help="timed decode steps per figure (median reported)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (1: steadier on a busy machine)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    sizes = cache_bytes_per_token()
    runs = {"MHA": ("MHA", False), "MLA naive": ("MLA", False), "MLA absorbed": ("MLA", True)}
    speed = {name: {c: decode_tokens_per_s(kind, c, absorb, args.steps) for c in args.contexts}
             for name, (kind, absorb) in runs.items()}  # fmt: skip
    if args.json:
        print(json.dumps({"bytes_per_token_per_layer": sizes, "decode_tokens_per_s": speed,
                          "threads": torch.get_num_threads()}))  # fmt: skip
        return
    print("KV-cache bytes per token per layer (fp32; d_model 1024, 16 query heads of 64)\n")
    print("| attention | cached per token | bytes | vs MHA |\n|---|---|---:|---:|")
    what = {
        "MHA": "K, V: 2 × 16 × 64",
        "GQA": "K, V: 2 × 4 × 64",
        "MQA": "K, V: 2 × 1 × 64",
        "MLA": "c_KV 256 + k_rope 32",
    }
    for kind, size in sizes.items():
        print(f"| {kind} | {what[kind]} | {size:,} | 1/{sizes['MHA'] / size:.1f} |")
    print(f"\nMLA ≤ 1/7 of MHA: {sizes['MLA'] * 7 <= sizes['MHA']}")
    print(f"\nDecode tokens/s, batch 1, 2 layers, {torch.get_num_threads()} thread(s), median of {args.steps} steps\n")
    print("| attention | " + " | ".join(f"context {c:,}" for c in args.contexts) + " |")
    print("|---|" + "---:|" * len(args.contexts))
    for name, row in speed.items():
        print(f"| {name} | " + " | ".join(f"{row[c]:.1f}" for c in args.contexts) + " |")


if __name__ == "__main__":
    main()
