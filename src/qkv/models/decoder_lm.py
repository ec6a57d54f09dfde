"""DecoderLM: the GPT-style decoder-only language model.

ids → Embeddings → N × DecoderLayer (causal self-attention + FFN, no cross-attention) → norm →
linear over the vocabulary (optionally the token embedding matrix itself: tied weights).
Trained to predict token t+1 from tokens ≤ t; generates by feeding its own samples back
(qkv.generation).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

from torch import Tensor, nn

from qkv.attention import LayerCache, MultiHeadAttentionConfig, cache_length
from qkv.blocks import BlockConfig, Decoder, FeedForwardConfig, StackConfig
from qkv.errors import QkvError
from qkv.models.config import ModelConfig, check_vocab, require_vocab
from qkv.models.embedding import EmbeddingConfig, Embeddings, init_normal_

# GPT-2's block: pre-norm, GELU, and no dropout by default (a language model on much data needs none).
GPT_BLOCK = BlockConfig(attention=MultiHeadAttentionConfig(dropout=0.0), ffn=FeedForwardConfig(activation="gelu",
                        dropout=0.0), norm_placement="pre", dropout=0.0)  # fmt: skip


@dataclass(frozen=True, kw_only=True)
class DecoderLMConfig(ModelConfig):
    """A decoder-only language model: embeddings, one stack of causal blocks, a head over the vocabulary."""

    model_type: ClassVar[str] = "decoder_lm"
    stacks: ClassVar[tuple[str, ...]] = ("decoder",)

    vocab_size: int | None = None  # None until a run's tokenizer gives it
    embedding: EmbeddingConfig = EmbeddingConfig(dropout=0.0)
    decoder: StackConfig = StackConfig(block=GPT_BLOCK)
    tie_embeddings: bool = True  # the output head is the token embedding matrix

    def check(self) -> None:
        """The model's rules and the vocabulary's."""
        check_vocab(self, "vocab_size")
        super().check()

    def build(self) -> DecoderLM:
        """The DecoderLM, initialised as GPT-2 is."""
        return DecoderLM(self)


class DecoderLM(nn.Module):
    """Decoder-only Transformer language model."""

    def __init__(self, cfg: DecoderLMConfig) -> None:
        super().__init__()
        require_vocab(cfg, "vocab_size")
        assert cfg.vocab_size is not None
        self.cfg = cfg
        self.embed = Embeddings(cfg.embedding, cfg.vocab_size, cfg.d_model, cfg.context_length, cfg.rotary_dim())
        self.decoder = Decoder(cfg.decoder, cfg.d_model, cross_attention=False)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        init_normal_(self, std=0.02, residual_std=0.02 / math.sqrt(2 * cfg.decoder.n_layers))
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed.tokens.weight  # one matrix embeds and un-embeds

    def new_cache(self, capacity: int = 256) -> list[LayerCache]:
        """An empty KV cache for incremental decoding (each layer's own kind: latent for MLA)."""
        return self.decoder.new_cache(capacity)

    def forward(self, ids: Tensor, cache: list[LayerCache] | None = None, padding_mask: Tensor | None = None) -> Tensor:
        """Logits (B, T, vocab) for ids (B, T) that follow the `cache`'s tokens, if any.

        padding_mask: (B, T_past + T) booleans, True on real tokens, for left-padded batches.
        """
        return self.lm_head(self.hidden(ids, cache, padding_mask))  # (B, T, vocab)

    def next_logits(self, ids: Tensor, cache: list[LayerCache] | None = None, padding_mask: Tensor | None = None,
                    positions: Tensor | None = None) -> Tensor:  # fmt: skip
        """Logits (B, vocab) of the last position alone: reading a prompt need not un-embed every position."""
        return self.lm_head(self.hidden(ids, cache, padding_mask, positions)[:, -1])

    def hidden(self, ids: Tensor, cache: list[LayerCache] | None = None, padding_mask: Tensor | None = None,
               positions: Tensor | None = None, mask: Tensor | None = None) -> Tensor:  # fmt: skip
        """The final (normed) hidden states (B, T, d_model) that lm_head maps to logits: scoring a few positions
        of a long sequence applies the head to those alone.

        positions (B, T) and mask (B, T, T; True = may attend, on top of causality) pack several sequences
        that share a beginning into one row: each keeps its own positions and sees only its own tokens.
        """
        start = cache_length(cache)
        x, rope = self.embed(ids, start=start, positions=positions)  # (B, T, d_model)
        self_mask = None if mask is None else mask[:, None]  # (B, 1, T, T)
        if padding_mask is not None:
            if padding_mask.shape != (ids.shape[0], start + ids.shape[1]):
                raise QkvError(
                    f"padding_mask must be (B, T_past + T) = {(ids.shape[0], start + ids.shape[1])}, "
                    f"got {tuple(padding_mask.shape)}"
                )
            keys = padding_mask[:, None, None, :]  # (B, 1, 1, T_k)
            self_mask = keys if self_mask is None else self_mask & keys
        return self.decoder(x, self_mask=self_mask, cache=cache, rope=rope)  # (B, T, d_model)
