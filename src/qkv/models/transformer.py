"""The encoder–decoder Transformer of "Attention Is All You Need" (Vaswani et al., 2017).

source ids → Embeddings (× √d_model, + sinusoidal positions) → Encoder → memory
target ids → Embeddings → Decoder (masked self-attention, cross-attention to memory, FFN)
           → linear over the target vocabulary → softmax gives P(next target token).
Teacher forcing: in training the decoder sees the whole (shifted) target at once and the causal
mask hides the future; at inference it runs token by token with a KV cache.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from torch import Tensor, nn

from qkv.attention import LayerCache, cache_length
from qkv.blocks import BlockConfig, Decoder, Encoder, StackConfig
from qkv.errors import QkvError
from qkv.models.config import ModelConfig, check_vocab, require_vocab
from qkv.models.embedding import EmbeddingConfig, Embeddings
from qkv.positional import SinusoidalPositionsConfig

PAPER_SIDE = StackConfig(block=BlockConfig())  # post-norm, ReLU, dropout 0.1, 8 heads: the paper's base


@dataclass(frozen=True, kw_only=True)
class TransformerConfig(ModelConfig):
    """The encoder–decoder Transformer: one embedding config for both sides, and a stack per side, each with its
    own depth, heads and widths (BART's and Marian's encoder_* and decoder_* settings)."""

    model_type: ClassVar[str] = "transformer"
    stacks: ClassVar[tuple[str, ...]] = ("encoder", "decoder")

    src_vocab_size: int | None = None  # None until a run's tokenizer gives them
    tgt_vocab_size: int | None = None
    embedding: EmbeddingConfig = EmbeddingConfig(positions=SinusoidalPositionsConfig(), scale=True)
    encoder: StackConfig = PAPER_SIDE
    decoder: StackConfig = PAPER_SIDE
    share_embeddings: bool = False  # one embedding matrix for source and target (a shared vocabulary)
    tie_embeddings: bool = True  # the output projection is the target embedding matrix (transposed)
    pad_id: int = 0
    output_bias: bool = False  # a bias on the output projection (BART's final_logits_bias)

    def check(self) -> None:
        """The model's rules; shared embeddings need one vocabulary."""
        check_vocab(self, "src_vocab_size", "tgt_vocab_size")
        super().check()
        if self.share_embeddings and self.src_vocab_size != self.tgt_vocab_size:
            raise QkvError(f"share_embeddings needs one vocabulary, got src_vocab_size={self.src_vocab_size} "
                           f"and tgt_vocab_size={self.tgt_vocab_size}")  # fmt: skip

    @classmethod
    def paper_base(cls, vocab_size: int) -> TransformerConfig:
        """The paper's base model: N=6, d_model=512, d_ff=2048, h=8, dropout 0.1, shared vocabulary."""
        return cls(src_vocab_size=vocab_size, tgt_vocab_size=vocab_size, d_model=512, share_embeddings=True)

    @classmethod
    def paper_big(cls, vocab_size: int) -> TransformerConfig:
        """The paper's big model: N=6, d_model=1024, d_ff=4096, h=16, dropout 0.3."""
        base = cls(src_vocab_size=vocab_size, tgt_vocab_size=vocab_size, d_model=1024, share_embeddings=True)
        return base.override({"attention.n_heads": 16, "ffn.d_ff": 4096, "dropout": 0.3})

    def build(self) -> Transformer:
        """The Transformer, initialised as the Annotated Transformer is (Xavier)."""
        return Transformer(self)


class Transformer(nn.Module):
    """Encoder–decoder Transformer; masks are boolean, True = may attend (see qkv.attention.masks)."""

    def __init__(self, cfg: TransformerConfig) -> None:
        super().__init__()
        require_vocab(cfg, "src_vocab_size", "tgt_vocab_size")
        assert cfg.src_vocab_size is not None and cfg.tgt_vocab_size is not None
        self.cfg = cfg
        d, n = cfg.d_model, cfg.context_length
        self.src_embed = Embeddings(cfg.embedding, cfg.src_vocab_size, d, n, cfg.rotary_dim("encoder"))
        self.tgt_embed = Embeddings(cfg.embedding, cfg.tgt_vocab_size, d, n, cfg.rotary_dim("decoder"))
        if cfg.share_embeddings:
            self.tgt_embed.tokens = self.src_embed.tokens  # one matrix for both languages
        self.encoder = Encoder(cfg.encoder, d)
        self.decoder = Decoder(cfg.decoder, d, cross_attention=True)
        self.generator = nn.Linear(cfg.d_model, cfg.tgt_vocab_size, bias=cfg.output_bias)
        for p in self.parameters():
            if p.dim() > 1:
                nn.init.xavier_uniform_(p)  # as the Annotated Transformer does
        if self.generator.bias is not None:
            nn.init.zeros_(self.generator.bias)  # a learned prior over the vocabulary, starting flat
        if cfg.tie_embeddings:
            self.generator.weight = self.tgt_embed.tokens.weight

    def new_cache(self, capacity: int = 256) -> list[LayerCache]:
        """An empty decoder cache (self-attention K/V grow; cross-attention K/V are set once)."""
        return self.decoder.new_cache(capacity)

    def encode(self, src: Tensor, src_mask: Tensor | None = None) -> Tensor:
        """Memory (B, S, d_model) for source ids (B, S); src_mask (B, 1, 1, S) hides padding."""
        x, rope = self.src_embed(src)
        return self.encoder(x, mask=src_mask, rope=rope)

    def decode(
        self,
        tgt: Tensor,
        memory: Tensor,
        src_mask: Tensor | None = None,
        tgt_mask: Tensor | None = None,
        cache: list[LayerCache] | None = None,
        positions: Tensor | None = None,
    ) -> Tensor:
        """Logits (B, T, tgt_vocab) for target ids (B, T) following the cache's tokens.

        src_mask (B, 1, 1, S) hides source padding from cross-attention; tgt_mask (B, 1, 1, T_k)
        hides target padding; the causal mask is always applied. positions (B, T): each row's own
        positions (rows of a slot cache, each at its own length), else the cache's length on.
        """
        x, rope = self.tgt_embed(tgt, start=cache_length(cache), positions=positions)
        x = self.decoder(x, memory, self_mask=tgt_mask, memory_mask=src_mask, cache=cache, rope=rope)
        return self.generator(x)

    def forward(
        self, src: Tensor, tgt: Tensor, src_mask: Tensor | None = None, tgt_mask: Tensor | None = None
    ) -> Tensor:
        """Teacher-forced logits (B, T, tgt_vocab) for source (B, S) and target input (B, T)."""
        memory = self.encode(src, src_mask)
        return self.decode(tgt, memory, src_mask, tgt_mask)
