"""What every kind of self-attention has in common: heads, biases and dropout on the weights.

A block declares its self-attention by one of these configs' kinds: `mha` (multi-head, grouped-query and
multi-query: qkv.attention.multi_head), `mla` (latent: qkv.attention.latent) and `sliding` (a window:
qkv.attention.sliding_window). Each kind's config builds its module; qkv.attention registers the kinds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Protocol

from torch import Tensor, nn

from qkv.attention.cache import KVCache
from qkv.config import Config, positive, probability
from qkv.errors import QkvError


class SelfAttention(Protocol):
    """What a block asks of its self-attention module (an nn.Module that build() makes), whatever its kind."""

    def __call__(self, x: Tensor, context: Tensor | None = None, mask: Tensor | None = None, causal: bool = False,
                 cache: KVCache | None = None, rope: tuple[Tensor, Tensor] | None = None) -> Tensor:  # fmt: skip
        """Attend from x (B, T, d_model); returns (B, T, d_model)."""

    def new_cache(self, capacity: int = 256) -> KVCache:
        """An empty cache of the kind this attention keeps."""


@dataclass(frozen=True, kw_only=True)
class AttentionConfig(Config):
    """The settings every kind of attention has; d_model comes from the model when it is built."""

    variants: ClassVar[dict[str, type[Config]] | None] = {}

    n_heads: int = 8
    bias: bool = True  # on the query, key, value and output projections
    dropout: float = 0.1  # on the attention weights while training (Tensor2Tensor's; the paper has none)

    def check(self) -> None:
        """A positive head count and a dropout probability."""
        positive(self, "n_heads")
        probability(self, "dropout")

    def check_width(self, d_model: int) -> None:
        """The rules that need the model's width: the heads split it evenly."""
        if d_model % self.n_heads:
            raise QkvError(f"n_heads={self.n_heads} must divide d_model={d_model}")

    def head_dim(self, d_model: int) -> int:
        """d_k = d_v = d_model / n_heads."""
        return d_model // self.n_heads

    def rotary_dim(self, d_model: int) -> int:
        """The dims of each query and key that rotary positions turn: the whole head."""
        return self.head_dim(d_model)

    def build(self, d_model: int, index: int = 0) -> nn.Module:
        """The attention module of layer `index` in a stack of width d_model."""
        kinds = ", ".join(self.variants or {})
        raise QkvError(f"{type(self).__name__} builds nothing itself; use one of its kinds: {kinds}")
