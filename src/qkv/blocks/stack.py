"""A stack of layers, the encoder or the decoder, and its config.

A stack is n_layers blocks of one BlockConfig, then a final norm where the blocks are pre-norm (their residual
stream is never normalised otherwise). Layers may differ: `layers` gives the first layers blocks of their own
(DeepSeek-V3 keeps its first three feed-forward layers dense before its mixture-of-experts ones).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

from torch import Tensor, nn

from qkv.attention import LayerCache
from qkv.blocks.block import BlockConfig, DecoderLayer, EncoderLayer, Rope
from qkv.config import Config, positive
from qkv.errors import QkvError


@dataclass(frozen=True, kw_only=True)
class StackConfig(Config):
    """n_layers layers: the first len(layers) with blocks of their own, the rest `block`; then a final norm."""

    n_layers: int = 6
    block: BlockConfig = BlockConfig()
    layers: tuple[BlockConfig, ...] = ()  # the first layers' blocks, where they differ from `block`
    final_norm: bool | None = None  # None = after pre-norm blocks only

    def check(self) -> None:
        """A positive depth that holds the per-layer blocks."""
        positive(self, "n_layers")
        if len(self.layers) > self.n_layers:
            raise QkvError(f"layers gives {len(self.layers)} blocks for n_layers={self.n_layers}")

    def blocks(self) -> list[BlockConfig]:
        """Each layer's block, first to last."""
        return [*self.layers, *[self.block] * (self.n_layers - len(self.layers))]

    def check_width(self, d_model: int) -> None:
        """Every block's rules that need the model's width."""
        for block in self.blocks():
            block.check_width(d_model)

    def has_final_norm(self) -> bool:
        """final_norm, or whether the last block is pre-norm."""
        return self.final_norm if self.final_norm is not None else self.blocks()[-1].norm_placement == "pre"

    def final(self, d_model: int) -> nn.Module | None:
        """The norm after the last layer (the last block's kind), or None."""
        return self.blocks()[-1].norm.build(d_model) if self.has_final_norm() else None


class Encoder(nn.Module):
    """N encoder layers, then a final norm if the config asks (pre-norm stacks need one)."""

    def __init__(self, stack: StackConfig, d_model: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(EncoderLayer(block, d_model, i) for i, block in enumerate(stack.blocks()))
        self.norm = stack.final(d_model)

    def forward(self, x: Tensor, mask: Tensor | None = None, rope: Rope = None) -> Tensor:
        """(B, T, d_model) → (B, T, d_model) encoder output ("memory")."""
        for layer in self.layers:
            x = layer(x, mask=mask, rope=rope)
        return self.norm(x) if self.norm is not None else x


class Decoder(nn.Module):
    """N decoder layers (with or without cross-attention), then an optional final norm."""

    def __init__(self, stack: StackConfig, d_model: int, cross_attention: bool = True) -> None:
        super().__init__()
        blocks = stack.blocks()
        self.layers = nn.ModuleList(DecoderLayer(block, d_model, cross_attention, i) for i, block in enumerate(blocks))
        self.norm = stack.final(d_model)

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
