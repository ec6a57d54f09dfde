"""Multi-head latent attention (MLA, DeepSeek-V2/V3) and its latent KV cache.

Why MLA. Decoding reads every layer's whole KV cache once per generated token, so the cache's size
bounds both the batch that fits in memory and the speed (memory traffic). Multi-head attention caches
2 · H · d_h numbers per token and layer; GQA/MQA shrink that by sharing K/V heads, at some cost in
quality. MLA instead compresses each token into one low-rank latent shared by all heads,

    c_KV = RMSNorm(W_DKV x)                  (d_c numbers, d_c ≪ 2 · H · d_h)
    k_nope_h = W_UK_h c_KV,   v_h = W_UV_h c_KV,

and caches only c_KV, plus one small RoPE key k_rope = RoPE(W_KR x) (d_r numbers) shared by all heads:
d_c + d_r numbers per token and layer (DeepSeek-V3: 512 + 64, vs 2 · 128 · 128 for MHA).

Why a separate ("decoupled") RoPE key. RoPE multiplies keys by a position-dependent rotation R_t.
q · R_t W_UK c would trap R_t between the query and W_UK, so W_UK could not be folded into the query
(below). Positions therefore ride on extra dims: q = [q_nope; q_rope], k = [k_nope; k_rope], and only the
rope halves are rotated. The scale is 1/√(d_nope + d_r), the dimension of that full q·k.

Absorption. q_nope_h · (W_UK_h c) = (W_UK_hᵀ q_nope_h) · c: fold W_UK into the query once per step and
score it directly against the cached latents. All heads then share the same keys [c; k_rope] and values
c, so this is multi-query attention with head dim d_c + d_r. Likewise Σ_t p_t W_UV_h c_t = W_UV_h Σ_t p_t c_t:
mix the latents first, then apply W_UV and W_O. The naive path instead decompresses K and V for every cached
token at every step (≈ 2 · T · d_c · H · (d_nope + d_v) FLOPs per layer); the absorbed one never does
(≈ 2 · H · T · (2 d_c + d_r)). Both give the same numbers; `absorb` picks one.

Queries may be compressed too (q_lora_rank): q = W_UQ RMSNorm(W_DQ x). That saves training activations,
not cache. Weight names follow the paper: W_DQ = q_down, W_UQ/W_QR = q_up, W_DKV/W_KR = kv_down, W_UK/W_UV = kv_up.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor, nn

from qkv.attention.cache import KVCache
from qkv.attention.config import AttentionConfig
from qkv.attention.masks import causal_mask
from qkv.attention.record import active_recorder
from qkv.attention.sdpa import scaled_dot_product_attention
from qkv.config import positive
from qkv.errors import QkvError
from qkv.norms import RMSNorm
from qkv.positional import apply_rotary

# DeepSeek normalises its latents with RMSNorm's default ε whatever the model's rms_norm_eps is.
LATENT_NORM_EPS = 1e-6


@AttentionConfig.register
@dataclass(frozen=True, kw_only=True)
class LatentAttentionConfig(AttentionConfig):
    """Multi-head latent attention; each size left None takes DeepSeek-V2's ratio to the head dim d_h."""

    kind: ClassVar[str] = "mla"
    kv_lora_rank: int | None = None  # d_c, the cached latent's width; None = 4 · d_h
    q_lora_rank: int | None = None  # the query latent's width; None = no query compression
    qk_nope_head_dim: int | None = None  # per-head q/k dims without positions; None = d_h
    qk_rope_head_dim: int | None = None  # per-head decoupled RoPE dims (even); None = d_h / 2, rounded to even
    v_head_dim: int | None = None  # None = d_h
    absorb: bool = False  # attend against the cached latent, W_UK and W_UV folded into query and output

    def check(self) -> None:
        """The shared rules; the sizes given must be positive, the RoPE dims even."""
        super().check()
        given = [n for n in ("kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
                 if getattr(self, n) is not None]  # fmt: skip
        positive(self, *given)
        if self.qk_rope_head_dim is not None and self.qk_rope_head_dim % 2:
            raise QkvError(f"qk_rope_head_dim must be even (RoPE rotates pairs of dims), got {self.qk_rope_head_dim}")

    def sizes(self, d_model: int) -> tuple[int, int, int, int]:
        """(kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim), the defaults filled for width d_model."""
        d_head = self.head_dim(d_model)
        return (self.kv_lora_rank or 4 * d_head, self.qk_nope_head_dim or d_head,
                self.qk_rope_head_dim or max(2, d_head // 4 * 2), self.v_head_dim or d_head)  # fmt: skip

    def rotary_dim(self, d_model: int) -> int:
        """MLA rotates only its decoupled RoPE dims."""
        return self.sizes(d_model)[2]

    def build(self, d_model: int, index: int = 0) -> LatentAttention:
        """LatentAttention over width d_model."""
        return LatentAttention(d_model, self.n_heads, *self.sizes(d_model), self.q_lora_rank, self.bias, self.dropout,
                               self.absorb)  # fmt: skip


class LatentKVCache(KVCache):
    """The MLA cache: per token only the latent c_KV (after kv_norm) and the rotated RoPE key, never K or V.

    Each token is stored as one row [c_KV; k_rope] of d_c + d_r numbers in a (B, 1, capacity, d_c + d_r)
    buffer that doubles when full (the 1 is the single latent "head" every query head reads). c_KV is stored
    after its RMSNorm, as DeepSeek does, so cached tokens are never re-normalised; k_rope is stored rotated,
    since a token's position never changes. In the absorbed form the row is the key and its c_KV part the
    value, which is what keys_values() returns.
    """

    def __init__(self, kv_lora_rank: int, capacity: int = 256) -> None:
        super().__init__(capacity)
        self.kv_lora_rank = kv_lora_rank  # d_c: where c_KV ends and k_rope begins in a row

    def extend(self, latent: Tensor) -> Tensor:
        """Add (B, 1, T_new, d_c + d_r) rows; return a view of all cached rows (B, 1, length, d_c + d_r)."""
        if latent.dim() != 4 or latent.shape[1] != 1 or latent.shape[-1] <= self.kv_lora_rank:
            shape = tuple(latent.shape)
            raise QkvError(f"latent rows must be (B, 1, T, d_c + d_r) with d_c={self.kv_lora_rank}, got {shape}")
        new_len = self.length + latent.shape[-2]
        if self._k is None or new_len > self._k.shape[-2]:
            self._reserve(latent, new_len)
        assert self._k is not None
        self._k[:, :, self.length : new_len] = latent
        self.length = new_len
        return self._k[:, :, :new_len]

    def _reserve(self, latent: Tensor, needed: int) -> None:
        """Reallocate with at least doubled capacity, so appends stay amortised O(1)."""
        if self._k is not None:  # the first allocation takes the capacity asked for
            self.capacity = max(2 * self.capacity, needed)
        self.capacity = max(self.capacity, needed)
        buffer = latent.new_empty(*latent.shape[:-2], self.capacity, latent.shape[-1])
        if self._k is not None and self.length > 0:
            buffer[:, :, : self.length] = self._k[:, :, : self.length]
        self._k = buffer

    def append(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """KVCache's interface with k = c_KV (B, 1, T_new, d_c), v = k_rope (B, 1, T_new, d_r); returns both, cached."""
        self.extend(torch.cat([k, v], dim=-1))
        return self.latents()

    def latents(self) -> tuple[Tensor, Tensor]:
        """Views of all cached c_KV (B, 1, length, d_c) and rotated k_rope (B, 1, length, d_r)."""
        rows = self._rows()
        return rows[..., : self.kv_lora_rank], rows[..., self.kv_lora_rank :]

    def keys_values(self) -> tuple[Tensor, Tensor]:
        """The absorbed form's keys [c_KV; k_rope] (B, 1, length, d_c + d_r) and values c_KV (a view of them)."""
        rows = self._rows()
        return rows, rows[..., : self.kv_lora_rank]

    def _rows(self) -> Tensor:
        """All cached rows (B, 1, length, d_c + d_r)."""
        assert self._k is not None, "empty latent KV cache"
        return self._k[:, :, : self.length]

    def set(self, k: Tensor, v: Tensor) -> None:
        """Not available: MLA is self-attention, there is nothing to compute once."""
        raise QkvError("a LatentKVCache holds self-attention latents; cross-attention uses a KVCache")

    def reorder(self, index: Tensor) -> None:
        """Keep batch rows `index` (in that order), for beam search."""
        if self._k is not None:
            self._k = self._k.index_select(0, index)

    def nbytes(self) -> int:
        """Bytes held by the cached rows (not the spare capacity)."""
        return 0 if self._k is None else self._rows().numel() * self._k.element_size()


class LatentAttention(nn.Module):
    """Multi-head latent attention: keys and values are decompressed from one cached low-rank latent per token."""

    records_attention = True  # record_attention labels this module's weights with its name

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        kv_lora_rank: int,
        qk_nope_head_dim: int,
        qk_rope_head_dim: int,
        v_head_dim: int,
        q_lora_rank: int | None = None,
        bias: bool = False,
        dropout: float = 0.0,
        absorb: bool = False,
    ) -> None:
        super().__init__()
        self.float_linears = ("kv_up",)  # weight absorption reads its matrix per head: not quantisable as a Linear
        sizes = {"d_model": d_model, "n_heads": n_heads, "kv_lora_rank": kv_lora_rank,
                 "qk_nope_head_dim": qk_nope_head_dim, "qk_rope_head_dim": qk_rope_head_dim, "v_head_dim": v_head_dim,
                 "q_lora_rank": 1 if q_lora_rank is None else q_lora_rank}  # fmt: skip
        for name, value in sizes.items():
            if value < 1:
                raise QkvError(f"{name} must be a positive integer, got {value}")
        if qk_rope_head_dim % 2:
            raise QkvError(f"qk_rope_head_dim must be even (RoPE rotates pairs), got {qk_rope_head_dim}")
        if not 0.0 <= dropout < 1.0:
            raise QkvError(f"attention dropout must be in [0, 1), got {dropout}")
        self.d_model, self.n_heads, self.kv_lora_rank = d_model, n_heads, kv_lora_rank
        self.d_nope, self.d_rope, self.d_v = qk_nope_head_dim, qk_rope_head_dim, v_head_dim
        self.dropout = dropout
        self.absorb = absorb  # decode against the latent (True) or decompress K and V first (False)
        self.scale = (qk_nope_head_dim + qk_rope_head_dim) ** -0.5  # 1/√d of the full q·k, in both paths
        d_q = n_heads * (qk_nope_head_dim + qk_rope_head_dim)
        # Queries [q_nope; q_rope] per head: straight from x, or through a normalised latent of q_lora_rank.
        self.q_proj = nn.Linear(d_model, d_q, bias=False) if q_lora_rank is None else None  # [W_UQ; W_QR]
        self.q_down = nn.Linear(d_model, q_lora_rank, bias=bias) if q_lora_rank else None  # W_DQ
        self.q_norm = RMSNorm(q_lora_rank, eps=LATENT_NORM_EPS) if q_lora_rank else None
        self.q_up = nn.Linear(q_lora_rank, d_q, bias=False) if q_lora_rank else None  # [W_UQ; W_QR]
        self.kv_down = nn.Linear(d_model, kv_lora_rank + qk_rope_head_dim, bias=bias)  # [W_DKV; W_KR]
        self.kv_norm = RMSNorm(kv_lora_rank, eps=LATENT_NORM_EPS)
        self.kv_up = nn.Linear(kv_lora_rank, n_heads * (qk_nope_head_dim + v_head_dim), bias=False)  # [W_UK; W_UV]
        self.out_proj = nn.Linear(n_heads * v_head_dim, d_model, bias=bias)  # W_O

    def new_cache(self, capacity: int = 256) -> LatentKVCache:
        """An empty cache for this layer."""
        return LatentKVCache(self.kv_lora_rank, capacity)

    def up_weights(self) -> tuple[Tensor, Tensor]:
        """Views of W_UK (H, d_nope, d_c) and W_UV (H, d_v, d_c), the per-head slices of kv_up."""
        w = self.kv_up.weight.view(self.n_heads, self.d_nope + self.d_v, self.kv_lora_rank)
        return w[:, : self.d_nope], w[:, self.d_nope :]

    def forward(
        self,
        x: Tensor,
        context: Tensor | None = None,
        mask: Tensor | None = None,
        causal: bool = False,
        cache: KVCache | None = None,
        rope: tuple[Tensor, Tensor] | None = None,
    ) -> Tensor:
        """Self-attention of x (B, T, d_model) over the cached tokens and itself; MultiHeadAttention's signature.

        rope: (cos, sin) (T, d_r) for x's positions (required: MLA's positions live in its RoPE dims).
        cache: a LatentKVCache; this step's latent rows are appended to it.
        Returns (B, T, d_model); inside `record_attention` the weights (B, H, T, T_k) are recorded.
        """
        if context is not None:
            raise QkvError("LatentAttention is self-attention only; use MultiHeadAttention for cross-attention")
        if rope is None:
            raise QkvError("LatentAttention needs rotary positions (cos, sin): use positions='rotary'")
        if x.dim() != 3 or x.shape[-1] != self.d_model:
            raise QkvError(f"attention input must be (B, T, d_model={self.d_model}), got {tuple(x.shape)}")
        if cache is not None and not isinstance(cache, LatentKVCache):
            raise QkvError("LatentAttention caches latents: pass a LatentKVCache (DecoderLM.new_cache makes them)")
        if mask is not None and mask.dim() > 4:
            raise QkvError(f"mask must broadcast to (B, H, T_q, T_k), got {mask.dim()} dims {tuple(mask.shape)}")
        b, t, _ = x.shape
        cos, sin = rope
        if self.q_proj is not None:
            q = self.q_proj(x)
        else:
            assert self.q_down is not None and self.q_norm is not None and self.q_up is not None
            q = self.q_up(self.q_norm(self.q_down(x)))
        q = q.view(b, t, self.n_heads, self.d_nope + self.d_rope).transpose(1, 2)  # (B, H, T, d_nope + d_r)
        q_nope, q_rope = q.split([self.d_nope, self.d_rope], dim=-1)
        q_rope = apply_rotary(q_rope, cos, sin)
        c_kv, k_rope = self.kv_down(x).split([self.kv_lora_rank, self.d_rope], dim=-1)  # (B, T, d_c), (B, T, d_r)
        k_rope = apply_rotary(k_rope[:, None], cos, sin)  # (B, 1, T, d_r): one RoPE key shared by every head
        c_kv = self.kv_norm(c_kv).to(k_rope.dtype)  # RMSNorm's fp32 weight must not promote bf16 latents
        latent = torch.cat([c_kv[:, None], k_rope], dim=-1)  # (B, 1, T, d_c + d_r): all a token keeps
        if cache is not None:
            latent = cache.extend(latent)  # (B, 1, T_past + T, d_c + d_r)
        attend = self._absorbed if self.absorb else self._naive
        context_vecs = attend(q_nope, q_rope, latent, mask, causal)  # (B, H, T, d_v)
        return self.out_proj(context_vecs.transpose(1, 2).reshape(b, t, self.n_heads * self.d_v))

    def _naive(self, q_nope: Tensor, q_rope: Tensor, latent: Tensor, mask: Tensor | None, causal: bool) -> Tensor:
        """Decompress every cached token's K and V from its latent, then ordinary multi-head attention."""
        b, t_k = latent.shape[0], latent.shape[-2]
        c_kv, k_rope = latent.split([self.kv_lora_rank, self.d_rope], dim=-1)  # (B, 1, T_k, d_c), (B, 1, T_k, d_r)
        kv = self.kv_up(c_kv).view(b, t_k, self.n_heads, self.d_nope + self.d_v).transpose(1, 2)
        k_nope, v = kv.split([self.d_nope, self.d_v], dim=-1)  # (B, H, T_k, d_nope), (B, H, T_k, d_v)
        k = torch.cat([k_nope, k_rope.expand(-1, self.n_heads, -1, -1)], dim=-1)  # (B, H, T_k, d_nope + d_r)
        q = torch.cat([q_nope, q_rope], dim=-1)  # (B, H, T_q, d_nope + d_r)
        return self._sdpa(q, k, v, mask, causal)

    def _absorbed(self, q_nope: Tensor, q_rope: Tensor, latent: Tensor, mask: Tensor | None, causal: bool) -> Tensor:
        """Attend straight against the latents: W_UK folded into the query, W_UV applied after the mixing."""
        b, h, t_q, _ = q_nope.shape
        t_k, d_c = latent.shape[-2], self.kv_lora_rank
        w_uk, w_uv = self.up_weights()  # (H, d_nope, d_c), (H, d_v, d_c)
        q_latent = q_nope @ w_uk  # W_UK_hᵀ q_nope_h, batched over heads: (B, H, T_q, d_c)
        q = torch.cat([q_latent, q_rope], dim=-1)  # (B, H, T_q, d_c + d_r), against keys [c_KV; k_rope]
        if active_recorder() is not None:  # recorded weights keep one row per head: broadcast K/V over the heads
            mixed = self._sdpa(q, latent, latent[..., :d_c], mask, causal)  # (B, H, T_q, d_c)
            return mixed @ w_uv.transpose(-1, -2)  # (B, H, T_q, d_v)
        # Every head reads the same keys and values, so fold the heads into the query axis: one
        # (H·T_q) × T_k product per sequence, with no copy of the cache per head (as multi-query attention).
        q = q.reshape(b, 1, h * t_q, d_c + self.d_rope)
        if causal and t_q > 1:  # the triangle belongs to positions, not to the folded rows: build it here
            tri = causal_mask(t_q, t_k, device=q.device)  # (T_q, T_k)
            mask = tri if mask is None else mask & tri
        if mask is not None:
            mask = mask.expand(b, h, t_q, t_k).reshape(b, 1, h * t_q, t_k)
        mixed = self._sdpa(q, latent, latent[..., :d_c], mask, False)  # (B, 1, H·T_q, d_c)
        return mixed.view(b, h, t_q, d_c) @ w_uv.transpose(-1, -2)  # W_UV_h · Σ_t p_t c_t: (B, H, T_q, d_v)

    def _sdpa(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, causal: bool) -> Tensor:
        """qkv's scaled_dot_product_attention with MLA's scale (and dropout while training)."""
        dropout_p = self.dropout if self.training else 0.0
        return scaled_dot_product_attention(q, k, v, mask, causal, self.scale, dropout_p)


def set_absorb(model: nn.Module, absorb: bool) -> int:
    """Switch every LatentAttention in `model` to the absorbed (True) or naive (False) path; returns how many."""
    layers = [m for m in model.modules() if isinstance(m, LatentAttention)]
    for layer in layers:
        layer.absorb = absorb
    return len(layers)


__all__ = ["LATENT_NORM_EPS", "LatentAttention", "LatentAttentionConfig", "LatentKVCache", "set_absorb"]
