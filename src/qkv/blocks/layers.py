"""Encoder and decoder layers, and the stacks made of them.

EncoderLayer = self-attention + feed-forward. DecoderLayer = masked (causal) self-attention +
cross-attention over the encoder output + feed-forward; without cross-attention it is the
GPT block, which is how `DecoderLM` is built. Each sublayer sits in a ResidualNorm.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import Tensor, nn

from qkv.attention import LayerCache, MultiHeadAttention
from qkv.attention.latent import LatentAttention
from qkv.blocks.feed_forward import FeedForward
from qkv.blocks.moe import MoEFeedForward
from qkv.blocks.residual import ResidualNorm
from qkv.config import BlockConfig, DecoderLMConfig
from qkv.errors import QkvError
from qkv.norms import make_norm

Rope = tuple[Tensor, Tensor] | None


@dataclass
class AttentionMaps:
    """Attention weights per layer, each (B, H, T_q, T_k); filled only when asked for."""

    self_attn: list[Tensor] = field(default_factory=list)
    cross_attn: list[Tensor] = field(default_factory=list)


def _attention(cfg: BlockConfig) -> MultiHeadAttention | LatentAttention:
    """A MultiHeadAttention shaped by the block config (LatentAttention for attention='mla')."""
    if isinstance(cfg, DecoderLMConfig) and cfg.attention == "mla":
        return LatentAttention.from_config(cfg)
    return MultiHeadAttention(cfg.d_model, cfg.n_heads, cfg.n_kv_heads, bias=cfg.bias, dropout=cfg.attn_dropout)


def _feed_forward(cfg: BlockConfig, index: int = 0) -> FeedForward | MoEFeedForward:
    """A FeedForward shaped by the block config (a mixture of experts past the config's first dense layers)."""
    assert cfg.d_ff is not None
    if isinstance(cfg, DecoderLMConfig) and cfg.moe_experts and index >= cfg.moe_first_dense:
        return MoEFeedForward.from_config(cfg)
    return FeedForward(cfg.d_model, cfg.d_ff, cfg.activation, cfg.dropout, cfg.bias)


class EncoderLayer(nn.Module):
    """Self-attention (every token sees every unmasked token) then feed-forward."""

    def __init__(self, cfg: BlockConfig) -> None:
        super().__init__()
        self.self_attn = _attention(cfg)
        self.attn_residual = ResidualNorm(cfg)
        self.ffn = _feed_forward(cfg)
        self.ffn_residual = ResidualNorm(cfg)

    def forward(
        self, x: Tensor, mask: Tensor | None = None, rope: Rope = None, return_weights: bool = False
    ) -> tuple[Tensor, Tensor | None]:
        """(B, T, d_model) → (B, T, d_model), and the self-attention weights if asked."""
        h = self.attn_residual.before(x)
        attn_weights = None
        if return_weights:
            attn_out, attn_weights = self.self_attn(h, mask=mask, rope=rope, return_weights=True)
        else:
            attn_out = self.self_attn(h, mask=mask, rope=rope)
        x = self.attn_residual.after(x, attn_out)
        x = self.ffn_residual.after(x, self.ffn(self.ffn_residual.before(x)))
        return x, attn_weights


class DecoderLayer(nn.Module):
    """Causal self-attention, optional cross-attention to the encoder output, then feed-forward."""

    def __init__(self, cfg: BlockConfig, cross_attention: bool = True, index: int = 0) -> None:
        super().__init__()
        self.self_attn = _attention(cfg)
        self.self_residual = ResidualNorm(cfg)
        self.cross_attn = _attention(cfg) if cross_attention else None
        self.cross_residual = ResidualNorm(cfg) if cross_attention else None
        self.ffn = _feed_forward(cfg, index)  # index: which layer of the stack this is
        self.ffn_residual = ResidualNorm(cfg)

    def forward(
        self,
        x: Tensor,
        memory: Tensor | None = None,
        self_mask: Tensor | None = None,
        memory_mask: Tensor | None = None,
        cache: LayerCache | None = None,
        rope: Rope = None,
        return_weights: bool = False,
    ) -> tuple[Tensor, Tensor | None, Tensor | None]:
        """(B, T, d_model) → (B, T, d_model), plus self- and cross-attention weights if asked."""
        self_cache = cache.self_attn if cache is not None else None
        h = self.self_residual.before(x)
        self_weights = cross_weights = None
        if return_weights:
            out, self_weights = self.self_attn(
                h, mask=self_mask, causal=True, cache=self_cache, rope=rope, return_weights=True
            )
        else:
            out = self.self_attn(h, mask=self_mask, causal=True, cache=self_cache, rope=rope)
        x = self.self_residual.after(x, out)
        if self.cross_attn is not None and self.cross_residual is not None:
            if memory is None:
                raise QkvError("this decoder layer has cross-attention: pass the encoder output as memory")
            cross_cache = cache.cross_attn if cache is not None else None
            h = self.cross_residual.before(x)
            if return_weights:
                out, cross_weights = self.cross_attn(
                    h, context=memory, mask=memory_mask, cache=cross_cache, return_weights=True
                )
            else:
                out = self.cross_attn(h, context=memory, mask=memory_mask, cache=cross_cache)
            x = self.cross_residual.after(x, out)
        x = self.ffn_residual.after(x, self.ffn(self.ffn_residual.before(x)))
        return x, self_weights, cross_weights


class Encoder(nn.Module):
    """N encoder layers, then a final norm if the config asks (pre-norm stacks need one)."""

    def __init__(self, cfg: BlockConfig, n_layers: int, final_norm: bool) -> None:
        super().__init__()
        self.layers = nn.ModuleList(EncoderLayer(cfg) for _ in range(n_layers))
        self.norm = make_norm(cfg.norm, cfg.d_model, cfg.norm_eps, bias=cfg.bias) if final_norm else None

    def forward(
        self, x: Tensor, mask: Tensor | None = None, rope: Rope = None, return_weights: bool = False
    ) -> tuple[Tensor, AttentionMaps]:
        """(B, T, d_model) → (B, T, d_model) encoder output ("memory")."""
        maps = AttentionMaps()
        for layer in self.layers:
            x, weights = layer(x, mask=mask, rope=rope, return_weights=return_weights)
            if weights is not None:
                maps.self_attn.append(weights)
        return (self.norm(x) if self.norm is not None else x), maps


class Decoder(nn.Module):
    """N decoder layers (with or without cross-attention), then an optional final norm."""

    def __init__(self, cfg: BlockConfig, n_layers: int, final_norm: bool, cross_attention: bool = True) -> None:
        super().__init__()
        self.layers = nn.ModuleList(DecoderLayer(cfg, cross_attention, i) for i in range(n_layers))
        self.norm = make_norm(cfg.norm, cfg.d_model, cfg.norm_eps, bias=cfg.bias) if final_norm else None

    def forward(
        self,
        x: Tensor,
        memory: Tensor | None = None,
        self_mask: Tensor | None = None,
        memory_mask: Tensor | None = None,
        cache: list[LayerCache] | None = None,
        rope: Rope = None,
        return_weights: bool = False,
    ) -> tuple[Tensor, AttentionMaps]:
        """(B, T, d_model) → (B, T, d_model); `cache` holds one LayerCache per layer."""
        maps = AttentionMaps()
        for i, layer in enumerate(self.layers):
            layer_cache = cache[i] if cache is not None else None
            x, self_w, cross_w = layer(
                x, memory, self_mask, memory_mask, cache=layer_cache, rope=rope, return_weights=return_weights
            )
            if self_w is not None:
                maps.self_attn.append(self_w)
            if cross_w is not None:
                maps.cross_attn.append(cross_w)
        return (self.norm(x) if self.norm is not None else x), maps
