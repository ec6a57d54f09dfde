"""Encoder and decoder layers, and the stacks made of them.

EncoderLayer = self-attention + feed-forward. DecoderLayer = masked (causal) self-attention +
cross-attention over the encoder output + feed-forward; without cross-attention it is the
GPT block, which is how `DecoderLM` is built. Each sublayer sits in a ResidualNorm.
Which attention and which feed-forward a layer has is declared in its BlockConfig
(`attention="mla"`, `moe_experts`), whatever model the layer belongs to.
"""

from __future__ import annotations

from typing import cast

from torch import Tensor, nn

from qkv.attention import KVCache, LayerCache, MultiHeadAttention
from qkv.attention.latent import LatentAttention
from qkv.blocks.feed_forward import FeedForward
from qkv.blocks.moe import MoEFeedForward
from qkv.blocks.residual import ResidualNorm
from qkv.config import BlockConfig
from qkv.errors import QkvError
from qkv.norms import make_norm

Rope = tuple[Tensor, Tensor] | None


def _self_attention(cfg: BlockConfig) -> MultiHeadAttention | LatentAttention:
    """The self-attention the block config declares: multi-head (grouped-query) or latent (attention='mla')."""
    if cfg.attention == "mla":
        return LatentAttention.from_config(cfg)
    return _cross_attention(cfg)


def _cross_attention(cfg: BlockConfig) -> MultiHeadAttention:
    """Multi-head attention shaped by the block config (cross-attention is always this kind)."""
    return MultiHeadAttention(cfg.d_model, cfg.n_heads, cfg.n_kv_heads, bias=cfg.bias, dropout=cfg.attn_dropout)


def _feed_forward(cfg: BlockConfig, index: int = 0) -> FeedForward | MoEFeedForward | None:
    """A FeedForward shaped by the block config (a mixture of experts past the config's first dense layers);
    None for attention-only layers (d_ff=0)."""
    assert cfg.d_ff is not None
    if cfg.d_ff == 0:
        return None
    if cfg.moe_experts and index >= cfg.moe_first_dense:
        return MoEFeedForward.from_config(cfg)
    return FeedForward(cfg.d_model, cfg.d_ff, cfg.activation, cfg.dropout, cfg.bias)


class EncoderLayer(nn.Module):
    """Self-attention (every token sees every unmasked token) then feed-forward."""

    def __init__(self, cfg: BlockConfig, index: int = 0) -> None:
        super().__init__()
        self.self_attn = _self_attention(cfg)
        self.attn_residual = ResidualNorm(cfg)
        self.ffn = _feed_forward(cfg, index)  # index: which layer of the stack this is
        self.ffn_residual = ResidualNorm(cfg) if self.ffn is not None else None

    def forward(self, x: Tensor, mask: Tensor | None = None, rope: Rope = None) -> Tensor:
        """(B, T, d_model) → (B, T, d_model)."""
        x = self.attn_residual(x, self.self_attn(self.attn_residual.before(x), mask=mask, rope=rope))
        return _feed_forward_sublayer(self, x)


class DecoderLayer(nn.Module):
    """Causal self-attention, optional cross-attention to the encoder output, then feed-forward."""

    def __init__(self, cfg: BlockConfig, cross_attention: bool = True, index: int = 0) -> None:
        super().__init__()
        self.self_attn = _self_attention(cfg)
        self.self_residual = ResidualNorm(cfg)
        self.cross_attn = _cross_attention(cfg) if cross_attention else None
        self.cross_residual = ResidualNorm(cfg) if cross_attention else None
        self.ffn = _feed_forward(cfg, index)  # index: which layer of the stack this is
        self.ffn_residual = ResidualNorm(cfg) if self.ffn is not None else None

    def new_cache(self, capacity: int = 256) -> LayerCache:
        """This layer's empty cache: its self-attention's own kind (latent for MLA), and a cross-attention K/V."""
        return LayerCache(self.self_attn.new_cache(capacity), KVCache(capacity))

    def forward(
        self,
        x: Tensor,
        memory: Tensor | None = None,
        self_mask: Tensor | None = None,
        memory_mask: Tensor | None = None,
        cache: LayerCache | None = None,
        rope: Rope = None,
    ) -> Tensor:
        """(B, T, d_model) → (B, T, d_model)."""
        self_cache = cache.self_attn if cache is not None else None
        h = self.self_residual.before(x)
        x = self.self_residual(x, self.self_attn(h, mask=self_mask, causal=True, cache=self_cache, rope=rope))
        if self.cross_attn is not None and self.cross_residual is not None:
            if memory is None:
                raise QkvError("this decoder layer has cross-attention: pass the encoder output as memory")
            cross_cache = cache.cross_attn if cache is not None else None
            h = self.cross_residual.before(x)
            x = self.cross_residual(x, self.cross_attn(h, context=memory, mask=memory_mask, cache=cross_cache))
        return _feed_forward_sublayer(self, x)


def _feed_forward_sublayer(layer: EncoderLayer | DecoderLayer, x: Tensor) -> Tensor:
    """x plus the layer's feed-forward output, in its residual norm; x itself for an attention-only layer."""
    if layer.ffn is None or layer.ffn_residual is None:
        return x
    return layer.ffn_residual(x, layer.ffn(layer.ffn_residual.before(x)))


class Encoder(nn.Module):
    """N encoder layers, then a final norm if the config asks (pre-norm stacks need one)."""

    def __init__(self, cfg: BlockConfig, n_layers: int, final_norm: bool) -> None:
        super().__init__()
        self.layers = nn.ModuleList(EncoderLayer(cfg, i) for i in range(n_layers))
        self.norm = make_norm(cfg.norm, cfg.d_model, cfg.norm_eps, bias=cfg.bias) if final_norm else None

    def forward(self, x: Tensor, mask: Tensor | None = None, rope: Rope = None) -> Tensor:
        """(B, T, d_model) → (B, T, d_model) encoder output ("memory")."""
        for layer in self.layers:
            x = layer(x, mask=mask, rope=rope)
        return self.norm(x) if self.norm is not None else x


class Decoder(nn.Module):
    """N decoder layers (with or without cross-attention), then an optional final norm."""

    def __init__(self, cfg: BlockConfig, n_layers: int, final_norm: bool, cross_attention: bool = True) -> None:
        super().__init__()
        self.layers = nn.ModuleList(DecoderLayer(cfg, cross_attention, i) for i in range(n_layers))
        self.norm = make_norm(cfg.norm, cfg.d_model, cfg.norm_eps, bias=cfg.bias) if final_norm else None

    def new_cache(self, capacity: int = 256) -> list[LayerCache]:
        """An empty cache per layer: each self-attention's own kind (latent for MLA), and a cross-attention K/V."""
        return [cast(DecoderLayer, layer).new_cache(capacity) for layer in self.layers]

    def forward(
        self,
        x: Tensor,
        memory: Tensor | None = None,
        self_mask: Tensor | None = None,
        memory_mask: Tensor | None = None,
        cache: list[LayerCache] | None = None,
        rope: Rope = None,
    ) -> Tensor:
        """(B, T, d_model) → (B, T, d_model); `cache` holds one LayerCache per layer."""
        for i, layer in enumerate(self.layers):
            layer_cache = cache[i] if cache is not None else None
            x = layer(x, memory, self_mask, memory_mask, cache=layer_cache, rope=rope)
        return self.norm(x) if self.norm is not None else x
