"""Multi-head attention: h heads attend in parallel in d_k = d_model / h dimensional subspaces.

MultiHead(Q, K, V) = Concat(head_1, …, head_h) W_O,  head_i = Attention(Q W_Qi, K W_Ki, V W_Vi).

All heads' projections are one Linear each (d_model → h·d_k), reshaped into heads, which is
the same as h separate (d_model → d_k) matrices side by side. With n_kv_heads < n_heads, groups
of query heads share one key/value head (grouped-query attention; n_kv_heads = 1 is multi-query
attention), which shrinks the KV cache by n_heads / n_kv_heads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from torch import Tensor, nn

from qkv.attention.cache import KVCache
from qkv.attention.config import AttentionConfig
from qkv.attention.sdpa import scaled_dot_product_attention
from qkv.errors import QkvError
from qkv.positional import apply_rotary


@AttentionConfig.register
@dataclass(frozen=True, kw_only=True)
class MultiHeadAttentionConfig(AttentionConfig):
    """Multi-head attention; n_kv_heads < n_heads shares key/value heads (grouped-query; 1 = multi-query)."""

    kind: ClassVar[str] = "mha"
    n_kv_heads: int | None = None  # None = n_heads

    def check(self) -> None:
        """The shared rules, and key/value heads that divide the query heads."""
        super().check()
        if self.n_kv_heads is not None and (self.n_kv_heads < 1 or self.n_heads % self.n_kv_heads):
            raise QkvError(f"n_kv_heads={self.n_kv_heads} must divide n_heads={self.n_heads}")

    def build(self, d_model: int, index: int = 0) -> MultiHeadAttention:
        """MultiHeadAttention over width d_model."""
        return MultiHeadAttention(d_model, self.n_heads, self.n_kv_heads, bias=self.bias, dropout=self.dropout)


class MultiHeadAttention(nn.Module):
    """Self- or cross-attention with n_heads query heads and n_kv_heads key/value heads."""

    records_attention = True  # record_attention labels this module's weights with its name

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        n_kv_heads: int | None = None,
        bias: bool = True,
        dropout: float = 0.0,
        d_context: int | None = None,
    ) -> None:
        super().__init__()
        n_kv_heads = n_heads if n_kv_heads is None else n_kv_heads
        if n_heads < 1 or d_model % n_heads != 0:
            raise QkvError(f"n_heads={n_heads} must divide d_model={d_model}")
        if n_kv_heads < 1 or n_heads % n_kv_heads != 0:
            raise QkvError(f"n_kv_heads={n_kv_heads} must divide n_heads={n_heads}")
        if not 0.0 <= dropout < 1.0:
            raise QkvError(f"attention dropout must be in [0, 1), got {dropout}")
        self.d_model, self.n_heads, self.n_kv_heads = d_model, n_heads, n_kv_heads
        self.d_head = d_model // n_heads
        self.dropout = dropout
        d_context = d_model if d_context is None else d_context
        self.q_proj = nn.Linear(d_model, n_heads * self.d_head, bias=bias)  # W_Q for all heads
        self.k_proj = nn.Linear(d_context, n_kv_heads * self.d_head, bias=bias)  # W_K
        self.v_proj = nn.Linear(d_context, n_kv_heads * self.d_head, bias=bias)  # W_V
        self.out_proj = nn.Linear(n_heads * self.d_head, d_model, bias=bias)  # W_O

    def _split_heads(self, x: Tensor, n_heads: int) -> Tensor:
        """(B, T, n·D) → (B, n, T, D)."""
        b, t, _ = x.shape
        return x.view(b, t, n_heads, self.d_head).transpose(1, 2)

    def forward(
        self,
        x: Tensor,
        context: Tensor | None = None,
        mask: Tensor | None = None,
        causal: bool = False,
        cache: KVCache | None = None,
        rope: tuple[Tensor, Tensor] | None = None,
    ) -> Tensor:
        """Attend from x (B, T_q, d_model) to itself, or to `context` (B, T_k, d_context).

        mask: boolean, True = may attend, broadcastable to (B, H, T_q, T_k) (see qkv.attention.masks).
        cache: self-attention appends this step's keys/values; cross-attention fills it once.
        rope: (cos, sin) for the positions of x's tokens; rotates queries and keys (self-attention only).
        Returns the output (B, T_q, d_model); inside `record_attention` the weights (B, H, T_q, T_k) are recorded.
        """
        if x.dim() != 3 or x.shape[-1] != self.d_model:
            raise QkvError(f"attention input must be (B, T, d_model={self.d_model}), got {tuple(x.shape)}")
        b, t_q, _ = x.shape
        q, k, v = self._queries_keys_values(x, context, cache, rope)
        if mask is not None and not 2 <= mask.dim() <= 4:
            raise QkvError(f"mask must broadcast to (B, H, T_q, T_k), got {mask.dim()} dims {tuple(mask.shape)}")
        dropout_p = self.dropout if self.training else 0.0
        context_vecs = scaled_dot_product_attention(q, k, v, mask=mask, causal=causal, dropout_p=dropout_p,
                                                    kv_groups=self.n_heads // self.n_kv_heads)  # (B, H, T_q, D)
        context_vecs = context_vecs.to(x.dtype)
        # Concat(head_1, …, head_h): (B, H, T_q, D) → (B, T_q, H·D), then W_O.
        return self.out_proj(context_vecs.transpose(1, 2).reshape(b, t_q, self.n_heads * self.d_head))

    def _queries_keys_values(self, x: Tensor, context: Tensor | None, cache: KVCache | None,
                             rope: tuple[Tensor, Tensor] | None) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
        """q (B, H, T_q, D) from x; k, v (B, H_kv, T_k, D) from x (with the cache's past), from the context, or
        from a cross-attention cache filled before."""
        b = x.shape[0]
        q = self._split_heads(self.q_proj(x), self.n_heads)  # (B, H, T_q, D)
        if context is None:  # self-attention: this step's tokens provide keys and values
            k = self._split_heads(self.k_proj(x), self.n_kv_heads)  # (B, H_kv, T_q, D)
            v = self._split_heads(self.v_proj(x), self.n_kv_heads)
            if rope is not None:
                cos, sin = rope
                q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
            if cache is not None:
                k, v = cache.append(k, v)  # (B, H_kv, T_past + T_q, D), in the cache's storage_dtype
                q = q.to(k.dtype)
        elif cache is not None and cache.length > 0:  # cross-attention, keys already computed
            k, v = cache.keys_values()
        else:
            if context.dim() != 3 or context.shape[0] != b:
                raise QkvError(
                    f"context must be (B={b}, T_k, d_context) for cross-attention, got {tuple(context.shape)}"
                )
            k = self._split_heads(self.k_proj(context), self.n_kv_heads)
            v = self._split_heads(self.v_proj(context), self.n_kv_heads)
            if cache is not None:
                cache.set(k, v)
        return q, k, v

    def new_cache(self, capacity: int = 256) -> KVCache:
        """An empty KV cache for this layer's keys and values."""
        return KVCache(capacity)
