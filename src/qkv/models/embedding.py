"""The input side of every model: token embedding (optionally × √d_model) plus positions.

Learned and sinusoidal positions are added to the token vectors; rotary positions are not added
but returned as (cos, sin) for the attention layers to rotate q and k with.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from qkv.blocks.dropout import Dropout
from qkv.config import EncoderConfig, ModelConfig
from qkv.errors import QkvError
from qkv.norms import make_norm
from qkv.positional import LearnedPositionalEmbedding, RotaryEmbedding, SinusoidalPositionalEncoding, check_length

Rope = tuple[Tensor, Tensor] | None


class Embeddings(nn.Module):
    """ids (B, T) → vectors (B, T, d_model) and the rotary (cos, sin) when positions are rotary."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.vocab_size, self.max_positions = cfg.vocab_size, cfg.max_positions
        self.tokens = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.scale = math.sqrt(cfg.d_model) if cfg.scale_embeddings else 1.0
        self.positions: LearnedPositionalEmbedding | SinusoidalPositionalEncoding | None = None
        self.rotary: RotaryEmbedding | None = None
        self.position_offset = cfg.position_offset
        if cfg.positions == "learned":
            # BART's table has `position_offset` extra rows in front that no position uses.
            self.positions = LearnedPositionalEmbedding(cfg.d_model, cfg.max_positions + cfg.position_offset)
        elif cfg.positions == "sinusoidal":
            self.positions = SinusoidalPositionalEncoding(cfg.d_model, cfg.max_positions, cfg.sinusoid_layout)
        elif cfg.positions == "rotary":
            self.rotary = RotaryEmbedding(cfg.rotary_dim, cfg.max_positions, base=cfg.rope_base)
        self.token_types: nn.Embedding | None = None
        self.norm: nn.Module | None = None
        if isinstance(cfg, EncoderConfig) and cfg.type_vocab_size > 0:  # BERT's segment embeddings
            self.token_types = nn.Embedding(cfg.type_vocab_size, cfg.d_model)
        if cfg.embedding_norm:  # BERT and BART normalise the summed embeddings
            self.norm = make_norm(cfg.norm, cfg.d_model, cfg.norm_eps, bias=cfg.bias)
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
        elif positions.numel():
            check_length(int(positions.max()), 1, self.max_positions)
        # One reduction, one host sync; the min/max for the message are computed only on failure. Skipped where
        # the ids come from training data, checked against the vocabulary when it was read: in a compiled graph
        # (which cannot branch on data) and in a GPU's training step (where the sync would stall every step).
        trusted = torch.compiler.is_compiling() or (ids.device.type != "cpu" and torch.is_grad_enabled())
        out_of_range = not trusted and ids.numel()
        if out_of_range and bool(((ids < 0) | (ids >= self.vocab_size)).any()):
            raise QkvError(
                f"token id out of range [0, {self.vocab_size}): got min {int(ids.min())}, max {int(ids.max())}"
            )
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
