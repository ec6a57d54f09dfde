"""The input side of every model: token embedding (optionally × √d_model) plus positions.

Learned and sinusoidal positions are added to the token vectors; rotary positions are not added
but returned as (cos, sin) for the attention layers to rotate q and k with.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from qkv.blocks.dropout import Dropout
from qkv.config import Config, probability
from qkv.errors import QkvError
from qkv.norms import NormConfig
from qkv.positional import (
    LearnedPositionalEmbedding,
    LearnedPositionsConfig,
    PositionsConfig,
    RotaryEmbedding,
    SinusoidalPositionalEncoding,
    check_length,
    check_positions,
)

Rope = tuple[Tensor, Tensor] | None


@dataclass(frozen=True, kw_only=True)
class EmbeddingConfig(Config):
    """How ids become vectors: token embeddings, positions, and what is done to their sum."""

    positions: PositionsConfig = LearnedPositionsConfig()
    scale: bool = False  # multiply token embeddings by √d_model, as the paper does
    norm: NormConfig | None = None  # a norm over the summed embeddings (BERT, BART)
    type_vocab_size: int = 0  # token-type (segment) embeddings: BERT has 2
    dropout: float = 0.1  # on the summed embeddings while training

    def check(self) -> None:
        """A type vocabulary ≥ 0 and a dropout probability."""
        if self.type_vocab_size < 0:
            raise QkvError(f"type_vocab_size must be ≥ 0, got {self.type_vocab_size}")
        probability(self, "dropout")


class Embeddings(nn.Module):
    """ids (B, T) → vectors (B, T, d_model) and the rotary (cos, sin) when positions are rotary."""

    def __init__(self, cfg: EmbeddingConfig, vocab_size: int, d_model: int, max_positions: int,
                 rotary_dim: int) -> None:  # fmt: skip
        super().__init__()
        self.vocab_size, self.max_positions = vocab_size, max_positions
        self.tokens = nn.Embedding(vocab_size, d_model)
        self.scale = math.sqrt(d_model) if cfg.scale else 1.0
        built = cfg.positions.build(d_model, max_positions, rotary_dim)  # added to the embeddings, or RoPE's tables
        added = (LearnedPositionalEmbedding, SinusoidalPositionalEncoding)
        self.positions = built if isinstance(built, added) else None
        self.rotary = built if isinstance(built, RotaryEmbedding) else None
        learned = cfg.positions if isinstance(cfg.positions, LearnedPositionsConfig) else None
        self.position_offset = learned.offset if learned is not None else 0  # rows of BART's table no position uses
        self.token_types = nn.Embedding(cfg.type_vocab_size, d_model) if cfg.type_vocab_size > 0 else None
        self.norm = cfg.norm.build(d_model) if cfg.norm is not None else None
        self.dropout = Dropout(cfg.dropout)

    def forward(self, ids: Tensor, start: int = 0, token_type_ids: Tensor | None = None,
                positions: Tensor | None = None) -> tuple[Tensor, Rope]:  # fmt: skip
        """Embed ids at positions start .. start + T − 1, or at `positions` (B, T) (several sequences packed into
        one row, each counting from its own start)."""
        if ids.dim() != 2:
            raise QkvError(f"token ids must have shape (B, T), got {tuple(ids.shape)}")
        if ids.dtype not in (torch.int64, torch.int32):
            raise QkvError(f"token ids must be an integer tensor, got {ids.dtype}")
        t = ids.shape[1]
        if positions is None:
            check_length(start, t, self.max_positions)
        else:
            check_positions(positions, self.max_positions)
        x = self.tokens(ids) * self.scale  # (B, T, d_model)
        if self.positions is not None and positions is not None:
            x = x + self.positions.at(positions + self.position_offset)  # (B, T, d_model)
        elif self.positions is not None:
            x = x + self.positions(t, start + self.position_offset)  # (T, d_model) broadcasts over the batch
        if self.token_types is not None:
            types = token_type_ids if token_type_ids is not None else torch.zeros_like(ids)
            x = x + self.token_types(types)
        if self.norm is not None:
            x = self.norm(x)
        rope = None
        if self.rotary is not None:
            rope = self.rotary.at(positions) if positions is not None else self.rotary(t, start)
        return self.dropout(x), rope


def init_normal_(module: nn.Module, std: float = 0.02, residual_std: float | None = None) -> None:
    """GPT-2/BERT initialisation: N(0, std) weights, zero biases, unit norms.

    residual_std: a smaller std for the projections that write into the residual stream
    (attention out_proj, FFN down), as GPT-2 does (std / √(2 · n_layers)), so the residual
    stream's variance does not grow with depth.
    """
    for name, sub in module.named_modules():
        if isinstance(sub, nn.Linear):
            # Only the projections that write into the residual stream (not MLA's q_down / kv_down).
            is_residual_out = name.rsplit(".", 1)[-1] in ("out_proj", "down")
            nn.init.normal_(sub.weight, std=residual_std if (residual_std and is_residual_out) else std)
            if sub.bias is not None:
                nn.init.zeros_(sub.bias)
        elif isinstance(sub, (nn.Embedding, LearnedPositionalEmbedding)):
            nn.init.normal_(sub.weight, std=std)
