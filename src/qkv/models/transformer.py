"""The encoder–decoder Transformer of "Attention Is All You Need" (Vaswani et al., 2017).

source ids → Embeddings (× √d_model, + sinusoidal positions) → Encoder → memory
target ids → Embeddings → Decoder (masked self-attention, cross-attention to memory, FFN)
           → linear over the target vocabulary → softmax gives P(next target token).
Teacher forcing: in training the decoder sees the whole (shifted) target at once and the causal
mask hides the future; at inference it runs token by token with a KV cache.
"""

from __future__ import annotations

from torch import Tensor, nn

from qkv.attention import LayerCache, cache_length
from qkv.blocks import Decoder, Encoder
from qkv.config import TransformerConfig
from qkv.models.embedding import Embeddings


class Transformer(nn.Module):
    """Encoder–decoder Transformer; masks are boolean, True = may attend (see qkv.attention.masks)."""

    def __init__(self, cfg: TransformerConfig) -> None:
        super().__init__()
        self.cfg = cfg
        assert cfg.final_norm is not None
        self.src_embed = Embeddings(cfg.model_config(cfg.src_vocab_size))
        self.tgt_embed = Embeddings(cfg.model_config(cfg.tgt_vocab_size))
        if cfg.share_embeddings:
            self.tgt_embed.tokens = self.src_embed.tokens  # one matrix for both languages
        self.encoder = Encoder(cfg, cfg.n_encoder_layers, final_norm=cfg.final_norm)
        self.decoder = Decoder(cfg, cfg.n_decoder_layers, final_norm=cfg.final_norm, cross_attention=True)
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
    ) -> Tensor:
        """Logits (B, T, tgt_vocab) for target ids (B, T) following the cache's tokens.

        src_mask (B, 1, 1, S) hides source padding from cross-attention; tgt_mask (B, 1, 1, T_k)
        hides target padding; the causal mask is always applied.
        """
        x, rope = self.tgt_embed(tgt, start=cache_length(cache))
        x = self.decoder(x, memory, self_mask=tgt_mask, memory_mask=src_mask, cache=cache, rope=rope)
        return self.generator(x)

    def forward(
        self, src: Tensor, tgt: Tensor, src_mask: Tensor | None = None, tgt_mask: Tensor | None = None
    ) -> Tensor:
        """Teacher-forced logits (B, T, tgt_vocab) for source (B, S) and target input (B, T)."""
        memory = self.encode(src, src_mask)
        return self.decode(tgt, memory, src_mask, tgt_mask)
