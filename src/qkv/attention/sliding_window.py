"""Sliding-window attention: each query sees only the `window` most recent positions (itself included).

Attention over T tokens costs O(T²); with a window W it costs O(T·W), and a decoder's KV cache holds at most
W positions however long the text grows (Longformer; Mistral 7B, W = 4096). Information still travels further
than W: a token sees W back in each layer, so L layers reach L·(W − 1) back. `global_every` = k makes every k-th
layer attend to the whole context instead (Gemma 2 alternates window and global layers: k = 2).

The module is multi-head attention with one more mask, so grouped-query heads, rotary positions and every
kernel behind scaled_dot_product_attention work as they do for dense attention. Causal attention sees the
window behind each query; bidirectional (encoder) attention sees W − 1 positions on either side.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from qkv.attention.cache import KVCache, storage_dtype
from qkv.attention.config import AttentionConfig
from qkv.attention.masks import sliding_window_mask
from qkv.attention.multi_head import MultiHeadAttention, MultiHeadAttentionConfig
from qkv.config import positive
from qkv.errors import QkvError


@AttentionConfig.register
@dataclass(frozen=True, kw_only=True)
class SlidingWindowAttentionConfig(MultiHeadAttentionConfig):
    """Multi-head attention within a window of recent positions; every global_every-th layer is global."""

    kind: ClassVar[str] = "sliding"
    window: int = 256  # positions each query sees, itself included
    global_every: int = 0  # k > 0: layers k−1, 2k−1, … attend to everything (0: every layer is windowed)

    def check(self) -> None:
        """The multi-head rules, a positive window and a non-negative period."""
        super().check()
        positive(self, "window")
        if self.global_every < 0:
            raise QkvError(f"global_every must be ≥ 0 (0: no global layers), got {self.global_every}")

    def is_global(self, index: int) -> bool:
        """Whether layer `index` attends to the whole context."""
        return self.global_every > 0 and (index + 1) % self.global_every == 0

    def build(self, d_model: int, index: int = 0) -> MultiHeadAttention:
        """Windowed attention for layer `index`, or dense attention where that layer is global."""
        if self.is_global(index):
            return super().build(d_model, index)
        return SlidingWindowAttention(d_model, self.n_heads, self.window, self.n_kv_heads, self.bias, self.dropout)


class SlidingWindowAttention(MultiHeadAttention):
    """Multi-head self-attention in which query i sees keys i − window + 1 … i (causal), or |i − j| < window."""

    def __init__(self, d_model: int, n_heads: int, window: int, n_kv_heads: int | None = None, bias: bool = True,
                 dropout: float = 0.0) -> None:  # fmt: skip
        super().__init__(d_model, n_heads, n_kv_heads, bias=bias, dropout=dropout)
        if window < 1:
            raise QkvError(f"the attention window must be at least 1 position, got {window}")
        self.window = window

    def forward(self, x: Tensor, context: Tensor | None = None, mask: Tensor | None = None, causal: bool = False,
                cache: KVCache | None = None, rope: tuple[Tensor, Tensor] | None = None) -> Tensor:  # fmt: skip
        """Multi-head attention with the window added to the mask (self-attention only; see MultiHeadAttention).

        The keys are this call's tokens after those a WindowKVCache still holds, the newest last; a mask over every
        position since the start (a padding mask) keeps its columns for them.
        """
        if context is not None:
            raise QkvError("sliding-window attention is self-attention; cross-attention is MultiHeadAttention")
        t_q = x.shape[1]
        t_k = t_q + (cache.kept() if isinstance(cache, WindowKVCache) else cache.length if cache is not None else 0)
        if mask is not None and mask.shape[-1] > t_k:
            mask = mask[..., -t_k:]
        window = self.window_mask(t_q, t_k, causal, x.device)  # (T_q, T_k), causality in it
        return super().forward(x, mask=window if mask is None else mask & window, cache=cache, rope=rope)

    def window_mask(self, t_q: int, t_k: int, causal: bool, device: torch.device) -> Tensor:
        """(T_q, T_k): keys i − W + 1 … i for causal query i, |i − j| < W otherwise; ends aligned (a cache's past)."""
        if causal:
            return sliding_window_mask(t_q, self.window, t_k, device=device)
        q_pos = torch.arange(t_q, device=device)[:, None] + (t_k - t_q)
        return (torch.arange(t_k, device=device)[None, :] - q_pos).abs() < self.window

    def new_cache(self, capacity: int = 256) -> KVCache:
        """A cache that keeps the last `window` positions only."""
        return WindowKVCache(self.window)

    def extra_repr(self) -> str:
        """The window, beside the projections PyTorch prints."""
        return f"window={self.window}"


class WindowKVCache(KVCache):
    """The keys and values of the last `window` positions; `length` counts every position seen.

    append returns the kept positions followed by the new ones, all contiguous and ending at the newest, which is
    what the end-aligned window mask expects; then only the last `window` stay.
    """

    def __init__(self, window: int) -> None:
        super().__init__(window)
        self.window = window

    def append(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Add (B, H_kv, T_new, D) keys/values; return the kept ones followed by them (B, H_kv, ≤ W + T_new, D)."""
        k, v = k.to(storage_dtype(k)), v.to(storage_dtype(v))
        if self._k is not None and self._v is not None and self._k.shape[-2] > 0:
            k, v = torch.cat([self._k, k], dim=-2), torch.cat([self._v, v], dim=-2)
        self.length += k.shape[-2] - self.kept()
        self._k, self._v = k[:, :, -self.window :].clone(), v[:, :, -self.window :].clone()
        return k, v

    def kept(self) -> int:
        """How many positions the cache holds (at most the window)."""
        return 0 if self._k is None else self._k.shape[-2]

    def keys_values(self) -> tuple[Tensor, Tensor]:
        """The kept (keys, values), each (B, H_kv, ≤ window, D), the newest last."""
        assert self._k is not None and self._v is not None, "empty KV cache"
        return self._k, self._v

    def crop(self, length: int) -> None:
        """Go back to the first `length` positions, if the window that ends there is still held; else to none.

        Callers read cache_length afterwards and re-read whatever the cache no longer holds.
        """
        length = max(0, min(length, self.length))
        drop = self.length - length
        first_needed = max(0, length - self.window + 1)  # the oldest position a query at `length` sees
        if drop and self._k is not None and self._v is not None:
            if first_needed < self.length - self.kept():
                self._k, self._v, self.length = None, None, 0
                return
            self._k, self._v = self._k[:, :, : self.kept() - drop], self._v[:, :, : self.kept() - drop]
        self.length = length

    def set(self, k: Tensor, v: Tensor) -> None:
        """Window caches serve self-attention only."""
        raise QkvError("a sliding-window cache serves self-attention; cross-attention keeps a KVCache")

    def nbytes(self) -> int:
        """Bytes held by the kept positions."""
        if self._k is None or self._v is None:
            return 0
        return self._k.numel() * self._k.element_size() + self._v.numel() * self._v.element_size()


__all__ = ["SlidingWindowAttention", "SlidingWindowAttentionConfig", "WindowKVCache"]
