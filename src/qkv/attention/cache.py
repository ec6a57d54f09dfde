"""KV caches for incremental decoding.

When generating token t, the keys and values of tokens 0 .. t−1 have not changed, so each layer
keeps them and computes K and V for the new token only: generation costs O(T) per token instead
of O(T²). Cross-attention keys/values come from the encoder output, which is fixed for the whole
generation, so they are computed once and reused.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor


def storage_dtype(t: Tensor) -> torch.dtype:
    """The dtype a cache keeps t's keys/values in: float32 for half precision on the CPU, else t's own.

    PyTorch's CPU attention kernels are slower in bfloat16 than in float32 (benchmarks/decode.py measures it;
    docs/speed.md has the figures), so on the CPU a half-precision model's cache, and its attention, are float32:
    twice the cache's memory, and numbers only more exact. GPUs keep the model's dtype.
    """
    if t.device.type == "cpu" and t.dtype in (torch.bfloat16, torch.float16):
        return torch.float32
    return t.dtype


class KVCache:
    """Keys and values (B, H_kv, T, D) of one attention layer, in a preallocated, growing buffer (storage_dtype)."""

    def __init__(self, capacity: int = 256) -> None:
        self.capacity = capacity
        self.length = 0
        self._k: Tensor | None = None
        self._v: Tensor | None = None

    def append(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Add (B, H_kv, T_new, D) keys/values; return views of all cached ones so far."""
        new_len = self.length + k.shape[-2]
        if self._k is None or self._v is None or new_len > self._k.shape[-2]:
            self._grow(k, v, new_len)
        assert self._k is not None and self._v is not None
        self._k[:, :, self.length : new_len] = k
        self._v[:, :, self.length : new_len] = v
        self.length = new_len
        return self.keys_values()

    def _grow(self, k: Tensor, v: Tensor, needed: int) -> None:
        """Reallocate with doubled capacity so appends stay amortised O(1)."""
        # The first buffer takes the configured capacity; each regrowth at least doubles it.
        capacity = max(self.capacity if self._k is None else 2 * self.capacity, needed)
        self.capacity = capacity
        new_k = k.new_empty(*k.shape[:-2], capacity, k.shape[-1], dtype=storage_dtype(k))
        new_v = v.new_empty(*v.shape[:-2], capacity, v.shape[-1], dtype=storage_dtype(v))
        if self._k is not None and self._v is not None and self.length > 0:
            new_k[:, :, : self.length] = self._k[:, :, : self.length]
            new_v[:, :, : self.length] = self._v[:, :, : self.length]
        self._k, self._v = new_k, new_v

    def set(self, k: Tensor, v: Tensor) -> None:
        """Store keys/values computed once (cross-attention over the encoder output)."""
        self._k, self._v = k, v
        self.length = k.shape[-2]
        self.capacity = self.length

    def keys_values(self) -> tuple[Tensor, Tensor]:
        """All cached (keys, values), each (B, H_kv, length, D)."""
        assert self._k is not None and self._v is not None, "empty KV cache"
        return self._k[:, :, : self.length], self._v[:, :, : self.length]

    def crop(self, length: int) -> None:
        """Keep the first `length` cached tokens (the buffer stays, so appends after it reuse it)."""
        self.length = min(self.length, max(length, 0))

    def reorder(self, index: Tensor) -> None:
        """Keep batch rows `index` (in that order): beam search reshuffles hypotheses each step."""
        if self._k is not None and self._v is not None:
            self._k = self._k.index_select(0, index)
            self._v = self._v.index_select(0, index)

    def nbytes(self) -> int:
        """Bytes held by the cached entries (not the spare capacity)."""
        if self._k is None or self._v is None:
            return 0
        k, v = self.keys_values()
        return k.numel() * k.element_size() + v.numel() * v.element_size()


@dataclass
class LayerCache:
    """The caches of one decoder layer: self-attention appends, cross-attention is set once."""

    self_attn: KVCache = field(default_factory=KVCache)
    cross_attn: KVCache = field(default_factory=KVCache)


def new_cache(n_layers: int, capacity: int = 256) -> list[LayerCache]:
    """An empty cache for a decoder stack of n_layers."""
    return [LayerCache(KVCache(capacity), KVCache(capacity)) for _ in range(n_layers)]


def cache_length(cache: list[LayerCache] | None) -> int:
    """How many tokens the decoder has already seen (0 for no cache)."""
    return 0 if not cache else cache[0].self_attn.length


def crop_cache(cache: list[LayerCache], length: int) -> None:
    """Keep the first `length` tokens in every layer's self-attention cache (a conversation's shared prefix)."""
    for layer in cache:
        layer.self_attn.crop(length)


def settled_length(cache: list[LayerCache]) -> int:
    """The tokens every layer holds, after cropping any layer that holds more (a forward pass stopped midway,
    by Ctrl-C, leaves the first layers one step ahead of the rest)."""
    length = min((layer.self_attn.length for layer in cache), default=0)
    crop_cache(cache, length)
    return length


def reorder_cache(cache: list[LayerCache], index: Tensor) -> None:
    """Keep batch rows `index` in every layer's self- and cross-attention caches (beam search)."""
    for layer in cache:
        layer.self_attn.reorder(index)
        layer.cross_attn.reorder(index)


__all__ = ["KVCache", "LayerCache", "cache_length", "crop_cache", "new_cache", "reorder_cache", "settled_length",
           "storage_dtype"]
