"""EncoderModel: the BERT-style encoder-only model.

ids (+ token types) → Embeddings (+ norm) → N × EncoderLayer (bidirectional self-attention) →
hidden states for every token, a pooled vector tanh(W · h_0) for the whole sequence, and, with the
masked-LM head, logits over the vocabulary for every position (what masked-language-model
pretraining trains: qkv.tasks.mlm).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from qkv.attention import MultiHeadAttentionConfig
from qkv.blocks import BlockConfig, Encoder, FeedForwardConfig, StackConfig
from qkv.errors import QkvError
from qkv.models.config import ModelConfig, check_vocab, require_vocab
from qkv.models.embedding import EmbeddingConfig, Embeddings, init_normal_
from qkv.norms import NormConfig
from qkv.positional import LearnedPositionsConfig

# BERT's block: post-norm, GELU, dropout 0.1.
BERT_BLOCK = BlockConfig(ffn=FeedForwardConfig(activation="gelu"), attention=MultiHeadAttentionConfig())


@dataclass(frozen=True, kw_only=True)
class EncoderConfig(ModelConfig):
    """An encoder-only model: embeddings (with token types and a norm, as BERT's), one bidirectional stack, a
    pooler over the first token and, for masked-language-model pretraining, a head over the vocabulary."""

    model_type: ClassVar[str] = "encoder"
    stacks: ClassVar[tuple[str, ...]] = ("encoder",)

    vocab_size: int | None = None  # None until a run's tokenizer gives it
    embedding: EmbeddingConfig = EmbeddingConfig(positions=LearnedPositionsConfig(), norm=NormConfig(),
                                                 type_vocab_size=2)  # fmt: skip
    encoder: StackConfig = StackConfig(block=BERT_BLOCK)
    tie_embeddings: bool = True  # the masked-LM head's output layer is the token embedding matrix
    pooler: bool = True  # tanh(W · h_[CLS]) as the sequence representation
    mlm_head: bool = False  # BERT's masked-LM head: transform (dense, activation, norm), then the output layer

    def check(self) -> None:
        """The model's rules and the vocabulary's."""
        check_vocab(self, "vocab_size")
        super().check()

    def build(self) -> EncoderModel:
        """The EncoderModel, initialised as BERT is."""
        return EncoderModel(self)


@dataclass
class EncoderOutput:
    """Per-token hidden states (B, T, d_model), pooled (B, d_model) or None, MLM logits (B, T, vocab) or None."""

    hidden: Tensor
    pooled: Tensor | None
    logits: Tensor | None = None


class MaskedLMHead(nn.Module):
    """BERT's masked-LM head: logits = W_out · Norm(act(W h + b)) + b_out, W_out tied to the token embeddings."""

    def __init__(self, d_model: int, vocab_size: int, block: BlockConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(d_model, d_model, bias=block.ffn.bias)
        self.norm = block.norm.build(d_model)
        self.output = nn.Linear(d_model, vocab_size)  # its bias: a learned prior over the vocabulary
        self.activation = block.ffn.activation

    def forward(self, hidden: Tensor) -> Tensor:
        """(B, T, d_model) → (B, T, vocab)."""
        h = self.dense(hidden)
        if self.activation == "relu":
            h = F.relu(h)
        elif self.activation == "gelu_tanh":
            h = F.gelu(h, approximate="tanh")
        elif self.activation == "silu":
            h = F.silu(h)
        else:  # gelu, and SwiGLU's case: one input, so its gate nonlinearity would need a second matrix
            h = F.gelu(h)
        return self.output(self.norm(h))


class EncoderModel(nn.Module):
    """Encoder-only Transformer with an optional pooler and an optional masked-LM head."""

    def __init__(self, cfg: EncoderConfig) -> None:
        super().__init__()
        require_vocab(cfg, "vocab_size")
        assert cfg.vocab_size is not None
        self.cfg = cfg
        self.embed = Embeddings(cfg.embedding, cfg.vocab_size, cfg.d_model, cfg.context_length, cfg.rotary_dim())
        self.encoder = Encoder(cfg.encoder, cfg.d_model)
        self.pooler = nn.Linear(cfg.d_model, cfg.d_model) if cfg.pooler else None
        last = cfg.encoder.blocks()[-1]
        self.mlm_head = MaskedLMHead(cfg.d_model, cfg.vocab_size, last) if cfg.mlm_head else None
        init_normal_(self, std=0.02, residual_std=0.02 / math.sqrt(2 * cfg.encoder.n_layers))
        if self.mlm_head is not None and cfg.tie_embeddings:
            self.mlm_head.output.weight = self.embed.tokens.weight

    def forward(
        self,
        ids: Tensor,
        attention_mask: Tensor | None = None,
        token_type_ids: Tensor | None = None,
        mlm_positions: Tensor | None = None,
    ) -> EncoderOutput:
        """Encode ids (B, T); attention_mask (B, T) is True (or 1) on real tokens, False on padding.

        mlm_positions (B, k): with the masked-LM head, logits (B, k, vocab) only at these positions, as BERT
        gathers them (pretraining predicts ~15 % of the tokens); without, logits (B, T, vocab) everywhere.
        """
        mask = None
        if attention_mask is not None:
            if attention_mask.shape != ids.shape:
                raise QkvError(
                    f"attention_mask must match ids' shape {tuple(ids.shape)}, got {tuple(attention_mask.shape)}"
                )
            mask = attention_mask.bool()[:, None, None, :]  # (B, 1, 1, T)
        x, rope = self.embed(ids, token_type_ids=token_type_ids)
        hidden = self.encoder(x, mask=mask, rope=rope)
        pooled = torch.tanh(self.pooler(hidden[:, 0])) if self.pooler is not None else None
        logits = None
        if self.mlm_head is not None:
            at = (
                hidden
                if mlm_positions is None
                else hidden.gather(1, mlm_positions[..., None].expand(-1, -1, hidden.shape[-1]))
            )
            logits = self.mlm_head(at)  # (B, T or k, vocab)
        return EncoderOutput(hidden, pooled, logits)

    def mean_pool(self, ids: Tensor, attention_mask: Tensor) -> Tensor:
        """Sentence embeddings (B, d_model): the mean of the real tokens' hidden states."""
        hidden = self(ids, attention_mask).hidden
        weights = attention_mask.to(hidden.dtype)[:, :, None]  # (B, T, 1)
        return (hidden * weights).sum(1) / weights.sum(1).clamp(min=1e-9)
