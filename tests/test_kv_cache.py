"""Tests for qkv.attention.cache: the growing KV cache, its helpers, and incremental decoding
through MultiHeadAttention equal to the full causal pass."""

from __future__ import annotations

import pytest
import torch

from qkv import MultiHeadAttention
from qkv.attention import (
    KVCache,
    LayerCache,
    cache_length,
    crop_cache,
    new_cache,
    reorder_cache,
    settled_length,
    storage_dtype,
)
from qkv.positional import RotaryEmbedding

MASK_KINDS = ("none", "padding", "arbitrary", "sliding", "combined")


# --------------------------------------------------------------------------------------------
# KV cache
# --------------------------------------------------------------------------------------------


def test_kv_cache_append_grows_and_keeps_contents() -> None:
    """Appends past the initial capacity reallocate and keep every earlier entry."""
    cache = KVCache(capacity=2)
    ks, vs = [], []
    for n in (1, 3, 2, 5):
        k, v = torch.randn(2, 3, n, 4), torch.randn(2, 3, n, 4)
        ks.append(k)
        vs.append(v)
        k_all, v_all = cache.append(k, v)
        assert torch.equal(k_all, torch.cat(ks, dim=2))
        assert torch.equal(v_all, torch.cat(vs, dim=2))
    assert cache.length == 11
    assert cache.capacity >= 11
    assert cache.nbytes() == 2 * 2 * 3 * 11 * 4 * 4
    index = torch.tensor([1, 0])
    cache.reorder(index)
    k_all, v_all = cache.keys_values()
    assert torch.equal(k_all, torch.cat(ks, dim=2)[index])
    assert torch.equal(v_all, torch.cat(vs, dim=2)[index])


def test_cache_helpers() -> None:
    """new_cache, cache_length and reorder_cache work over all layers."""
    caches = new_cache(3, capacity=4)
    assert len(caches) == 3 and all(isinstance(c, LayerCache) for c in caches)
    assert cache_length(caches) == 0 and cache_length(None) == 0
    for c in caches:
        c.self_attn.append(torch.arange(6.0).reshape(2, 1, 3, 1), torch.zeros(2, 1, 3, 1))
        c.cross_attn.set(torch.arange(4.0).reshape(2, 1, 2, 1), torch.zeros(2, 1, 2, 1))
    assert cache_length(caches) == 3
    reorder_cache(caches, torch.tensor([1, 1]))
    for c in caches:
        assert torch.equal(c.self_attn.keys_values()[0][:, 0, :, 0], torch.tensor([[3.0, 4, 5], [3, 4, 5]]))
        assert torch.equal(c.cross_attn.keys_values()[0][:, 0, :, 0], torch.tensor([[2.0, 3], [2, 3]]))


def test_a_cropped_cache_keeps_its_start_and_appends_after_it() -> None:
    """crop_cache keeps the first n tokens in every layer; settled_length crops layers a stopped pass left ahead."""
    caches = new_cache(2, capacity=8)
    k = torch.arange(5.0).reshape(1, 1, 5, 1)
    for c in caches:
        c.self_attn.append(k, -k)
    crop_cache(caches, 3)
    assert cache_length(caches) == 3
    caches[0].self_attn.append(torch.full((1, 1, 2, 1), 9.0), torch.zeros(1, 1, 2, 1))  # layer 0 ran, layer 1 not
    assert settled_length(caches) == 3 and [c.self_attn.length for c in caches] == [3, 3]
    for c in caches:
        keys, values = c.self_attn.append(torch.full((1, 1, 1, 1), 7.0), torch.ones(1, 1, 1, 1))
        assert keys.flatten().tolist() == [0.0, 1.0, 2.0, 7.0] and values.flatten().tolist() == [-0.0, -1, -2, 1]
    crop_cache(caches, 10)  # longer than held: nothing changes
    assert cache_length(caches) == 4


@pytest.mark.parametrize("n_kv_heads", [4, 2, 1])
@pytest.mark.parametrize("use_rope", [False, True])
def test_mha_incremental_decoding_matches_full_causal(n_kv_heads: int, use_rope: bool) -> None:
    """Feeding tokens one (or a few) at a time through the cache equals one causal pass."""
    mha = MultiHeadAttention(16, 4, n_kv_heads=n_kv_heads).eval()
    rotary = RotaryEmbedding(4, 32)
    x = torch.randn(2, 7, 16)
    with torch.no_grad():
        full = mha(x, causal=True, rope=rotary(7) if use_rope else None)
        cache = KVCache(capacity=2)
        steps, pos = [], 0
        for n in (3, 1, 1, 2):
            rope = rotary(n, start=pos) if use_rope else None
            steps.append(mha(x[:, pos : pos + n], causal=True, cache=cache, rope=rope))
            pos += n
    assert cache.length == 7
    assert cache.keys_values()[0].shape == (2, n_kv_heads, 7, 4)
    assert (torch.cat(steps, dim=1) - full).abs().max().item() <= 1e-5


def test_cross_attention_cache_is_filled_once() -> None:
    """Cross-attention stores the context's K/V on the first call and reuses them afterwards."""
    mha = MultiHeadAttention(16, 4).eval()
    x, ctx = torch.randn(2, 3, 16), torch.randn(2, 5, 16)
    cache = KVCache()
    with torch.no_grad():
        full = mha(x, context=ctx)
        first = mha(x[:, :1], context=ctx, cache=cache)
        rest = mha(x[:, 1:], context=ctx, cache=cache)
    assert cache.length == 5
    assert (torch.cat([first, rest], dim=1) - full).abs().max().item() <= 1e-6


def test_kv_cache_grows_geometrically() -> None:
    """Appending one token at a time reallocates O(log T) times, not once per token."""
    from qkv.attention.cache import KVCache

    cache = KVCache(capacity=4)
    capacities = []
    for _ in range(100):
        cache.append(torch.randn(1, 2, 1, 3), torch.randn(1, 2, 1, 3))
        capacities.append(cache.capacity)
    assert sorted(set(capacities)) == [4, 8, 16, 32, 64, 128]
    assert cache.length == 100


def test_half_precision_cache_on_the_cpu_holds_float32() -> None:
    """A bfloat16 model's CPU cache keeps its keys exactly, in float32; attention there runs in float32."""
    torch.manual_seed(0)
    mha = MultiHeadAttention(16, 4, n_kv_heads=2).eval().to(torch.bfloat16)
    x = torch.randn(2, 5, 16, dtype=torch.bfloat16)
    cache = KVCache()
    with torch.no_grad():
        full = mha(x, causal=True)
        steps = [mha(x[:, i : i + 1], causal=True, cache=cache) for i in range(5)]
        # The same products as the steps (one token each: a batch of 5 may round differently), (B, H_kv, T, D).
        keys = torch.cat([mha.k_proj(x[:, i : i + 1]) for i in range(5)], dim=1).view(2, 5, 2, 4).transpose(1, 2)
    cached_keys, cached_values = cache.keys_values()
    assert cached_keys.dtype == cached_values.dtype == torch.float32
    assert torch.equal(cached_keys, keys.float())  # bfloat16 → float32 is exact
    out = torch.cat(steps, dim=1)
    assert out.dtype == torch.bfloat16
    assert (out.float() - full.float()).abs().max().item() <= 2e-2  # bfloat16 rounding of the full pass
    assert storage_dtype(torch.empty(1, dtype=torch.bfloat16, device="meta")) == torch.bfloat16  # not the CPU
    assert storage_dtype(torch.empty(1, dtype=torch.float64)) == torch.float64
