"""DecoderLM: the GPT-style decoder-only language model.

ids → Embeddings → N × DecoderLayer (causal self-attention + FFN, no cross-attention) → norm →
linear over the vocabulary (optionally the token embedding matrix itself: tied weights).
Trained to predict token t+1 from tokens ≤ t; generates by feeding its own samples back.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, Literal, overload

import torch
from torch import Tensor, nn

from qkv.attention import KVCache, LayerCache, cache_length, new_cache
from qkv.attention.latent import LatentKVCache
from qkv.blocks import AttentionMaps, Decoder
from qkv.config import DecoderLMConfig
from qkv.errors import QkvError
from qkv.generation import generate
from qkv.models.embedding import Embeddings, init_normal_

if TYPE_CHECKING:
    from qkv.tokenizers import ByteBPETokenizer


class DecoderLM(nn.Module):
    """Decoder-only Transformer language model."""

    def __init__(self, cfg: DecoderLMConfig) -> None:
        super().__init__()
        self.cfg = cfg
        assert cfg.final_norm is not None
        self.embed = Embeddings(cfg)
        self.decoder = Decoder(cfg, cfg.n_layers, final_norm=cfg.final_norm, cross_attention=False)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        init_normal_(self, std=0.02, residual_std=0.02 / math.sqrt(2 * cfg.n_layers))
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed.tokens.weight  # one matrix embeds and un-embeds

    def new_cache(self, capacity: int = 256) -> list[LayerCache]:
        """An empty KV cache for incremental decoding (latent-only caches for MLA layers)."""
        if self.cfg.attention == "mla":
            assert self.cfg.kv_lora_rank is not None
            return [LayerCache(LatentKVCache(self.cfg.kv_lora_rank, capacity), KVCache(capacity))
                    for _ in range(self.cfg.n_layers)]  # fmt: skip
        return new_cache(self.cfg.n_layers, capacity)

    @overload
    def forward(
        self,
        ids: Tensor,
        cache: list[LayerCache] | None = ...,
        padding_mask: Tensor | None = ...,
        return_weights: Literal[False] = ...,
    ) -> Tensor: ...
    @overload
    def forward(
        self,
        ids: Tensor,
        cache: list[LayerCache] | None = ...,
        padding_mask: Tensor | None = ...,
        *,
        return_weights: Literal[True],
    ) -> tuple[Tensor, AttentionMaps]: ...
    def forward(
        self,
        ids: Tensor,
        cache: list[LayerCache] | None = None,
        padding_mask: Tensor | None = None,
        return_weights: bool = False,
    ) -> Tensor | tuple[Tensor, AttentionMaps]:
        """Logits (B, T, vocab) for ids (B, T) that follow the `cache`'s tokens, if any.

        padding_mask: (B, T_past + T) booleans, True on real tokens, for left-padded batches.
        """
        start = cache_length(cache)
        x, rope = self.embed(ids, start=start)  # (B, T, d_model)
        self_mask = None
        if padding_mask is not None:
            if padding_mask.shape != (ids.shape[0], start + ids.shape[1]):
                raise QkvError(
                    f"padding_mask must be (B, T_past + T) = {(ids.shape[0], start + ids.shape[1])}, "
                    f"got {tuple(padding_mask.shape)}"
                )
            self_mask = padding_mask[:, None, None, :]  # (B, 1, 1, T_k)
        x, maps = self.decoder(x, self_mask=self_mask, cache=cache, rope=rope, return_weights=return_weights)
        logits = self.lm_head(x)  # (B, T, vocab)
        return (logits, maps) if return_weights else logits

    def generate(
        self,
        ids: Tensor,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_k: int | None = None,
        top_p: float | None = None,
        eos_id: int | None = None,
        use_cache: bool = True,
        generator: torch.Generator | None = None,
    ) -> Tensor:
        """Continue ids (B, T) by up to max_new_tokens sampled tokens (temperature 0 = greedy)."""
        return generate(self, ids, max_new_tokens, temperature, top_k, top_p, eos_id, use_cache, generator)

    def save_hf(self, directory: str | Path, tokenizer: ByteBPETokenizer | None = None) -> None:
        """Write a Hugging Face checkpoint (GPT-2 or Llama family, + tokenizer) that transformers can load."""
        from qkv.interop import save_hf  # lazy: qkv.interop imports this module

        save_hf(self, directory, tokenizer)
