"""Encoder and decoder layers, and the config of one.

EncoderLayer = self-attention + feed-forward. DecoderLayer = masked (causal) self-attention +
cross-attention over the encoder output + feed-forward; without cross-attention it is the
GPT block, which is how `DecoderLM` is built. Each sublayer sits in a ResidualNorm. Which attention
and which feed-forward a layer has is its BlockConfig's to say, whatever model the layer belongs to.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, cast

from torch import Tensor, nn

from qkv.attention import AttentionConfig, KVCache, LayerCache, MultiHeadAttentionConfig
from qkv.attention.config import SelfAttention
from qkv.blocks.feed_forward import FeedForwardConfig
from qkv.blocks.residual import ResidualNorm
from qkv.config import Config, probability
from qkv.errors import QkvError
from qkv.norms import NormConfig

Rope = tuple[Tensor, Tensor] | None
NormPlacement = Literal["pre", "post"]


@dataclass(frozen=True, kw_only=True)
class BlockConfig(Config):
    """One layer: its self-attention, its feed-forward, the norm around each, and the residual dropout."""

    attention: AttentionConfig = MultiHeadAttentionConfig()
    ffn: FeedForwardConfig = FeedForwardConfig()
    norm: NormConfig = NormConfig()
    norm_placement: NormPlacement = "post"
    dropout: float = 0.1  # on each sublayer's output, before it joins the residual stream (the paper's P_drop)

    def check(self) -> None:
        """A dropout probability."""
        probability(self, "dropout")

    def check_width(self, d_model: int) -> None:
        """The rules that need the model's width."""
        self.attention.check_width(d_model)

    def cross_attention(self) -> MultiHeadAttentionConfig:
        """The cross-attention of a decoder layer: always multi-head, with the self-attention's heads and biases."""
        kv_heads = self.attention.n_kv_heads if isinstance(self.attention, MultiHeadAttentionConfig) else None
        return MultiHeadAttentionConfig(n_heads=self.attention.n_heads, n_kv_heads=kv_heads, bias=self.attention.bias,
                                        dropout=self.attention.dropout)  # fmt: skip

    def residual(self, d_model: int) -> ResidualNorm:
        """The norm and dropout around one sublayer."""
        return ResidualNorm(d_model, self.norm, self.norm_placement == "pre", self.dropout)


class EncoderLayer(nn.Module):
    """Self-attention (every token sees every unmasked token) then feed-forward."""

    def __init__(self, block: BlockConfig, d_model: int, index: int = 0) -> None:
        super().__init__()
        self.self_attn = block.attention.build(d_model, index)  # index: which layer of the stack this is
        self.attn_residual = block.residual(d_model)
        self.ffn = block.ffn.build(d_model)
        self.ffn_residual = block.residual(d_model) if self.ffn is not None else None

    def forward(self, x: Tensor, mask: Tensor | None = None, rope: Rope = None) -> Tensor:
        """(B, T, d_model) → (B, T, d_model)."""
        x = self.attn_residual(x, self.self_attn(self.attn_residual.before(x), mask=mask, rope=rope))
        return _feed_forward_sublayer(self, x)


class DecoderLayer(nn.Module):
    """Causal self-attention, optional cross-attention to the encoder output, then feed-forward."""

    def __init__(self, block: BlockConfig, d_model: int, cross_attention: bool = True, index: int = 0) -> None:
        super().__init__()
        self.self_attn = block.attention.build(d_model, index)
        self.self_residual = block.residual(d_model)
        self.cross_attn = block.cross_attention().build(d_model) if cross_attention else None
        self.cross_residual = block.residual(d_model) if cross_attention else None
        self.ffn = block.ffn.build(d_model)
        self.ffn_residual = block.residual(d_model) if self.ffn is not None else None

    def new_cache(self, capacity: int = 256) -> LayerCache:
        """This layer's empty cache: its self-attention's own kind (latent for MLA), and a cross-attention K/V."""
        return LayerCache(cast(SelfAttention, self.self_attn).new_cache(capacity), KVCache(capacity))

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
