"""EncoderModel: the BERT-style encoder-only model.

ids (+ token types) → Embeddings (+ norm) → N × EncoderLayer (bidirectional self-attention) →
hidden states for every token, and a pooled vector tanh(W · h_0) for the whole sequence.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from qkv.blocks import AttentionMaps, Encoder
from qkv.config import EncoderConfig
from qkv.errors import QkvError
from qkv.models.embedding import Embeddings, init_normal_


@dataclass
class EncoderOutput:
    """Per-token hidden states (B, T, d_model), pooled (B, d_model) or None, attention maps."""

    hidden: Tensor
    pooled: Tensor | None
    attentions: AttentionMaps


class EncoderModel(nn.Module):
    """Encoder-only Transformer with an optional pooler."""

    def __init__(self, cfg: EncoderConfig) -> None:
        super().__init__()
        self.cfg = cfg
        assert cfg.final_norm is not None
        self.embed = Embeddings(cfg)
        self.encoder = Encoder(cfg, cfg.n_layers, final_norm=cfg.final_norm)
        self.pooler = nn.Linear(cfg.d_model, cfg.d_model) if cfg.pooler else None
        init_normal_(self, std=0.02, residual_std=0.02 / math.sqrt(2 * cfg.n_layers))

    def forward(
        self,
        ids: Tensor,
        attention_mask: Tensor | None = None,
        token_type_ids: Tensor | None = None,
        return_weights: bool = False,
    ) -> EncoderOutput:
        """Encode ids (B, T); attention_mask (B, T) is True (or 1) on real tokens, False on padding."""
        mask = None
        if attention_mask is not None:
            if attention_mask.shape != ids.shape:
                raise QkvError(
                    f"attention_mask must match ids' shape {tuple(ids.shape)}, got {tuple(attention_mask.shape)}"
                )
            mask = attention_mask.bool()[:, None, None, :]  # (B, 1, 1, T)
        x, rope = self.embed(ids, token_type_ids=token_type_ids)
        hidden, maps = self.encoder(x, mask=mask, rope=rope, return_weights=return_weights)
        pooled = torch.tanh(self.pooler(hidden[:, 0])) if self.pooler is not None else None
        return EncoderOutput(hidden, pooled, maps)

    def mean_pool(self, ids: Tensor, attention_mask: Tensor) -> Tensor:
        """Sentence embeddings (B, d_model): the mean of the real tokens' hidden states."""
        hidden = self(ids, attention_mask).hidden
        weights = attention_mask.to(hidden.dtype)[:, :, None]  # (B, T, 1)
        return (hidden * weights).sum(1) / weights.sum(1).clamp(min=1e-9)
