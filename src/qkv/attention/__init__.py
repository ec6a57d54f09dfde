"""Attention: scaled dot-product attention, masks, multi-head / grouped-query / latent / sliding-window attention,
KV caches, and recording the attention weights.

Importing a kind's module registers its config with AttentionConfig: a block may then declare it by its kind.
"""

from qkv.attention.cache import (
    KVCache,
    LayerCache,
    cache_length,
    crop_cache,
    new_cache,
    reorder_cache,
    settled_length,
    storage_dtype,
)
from qkv.attention.config import AttentionConfig
from qkv.attention.latent import LatentAttention, LatentAttentionConfig, LatentKVCache, set_absorb
from qkv.attention.masks import (
    causal_mask,
    combine_masks,
    padding_mask_from_ids,
    padding_mask_from_lengths,
    sliding_window_mask,
)
from qkv.attention.multi_head import MultiHeadAttention, MultiHeadAttentionConfig
from qkv.attention.record import AttentionRecord, AttentionRecorder, record_attention
from qkv.attention.sdpa import scaled_dot_product_attention
from qkv.attention.sliding_window import SlidingWindowAttention, SlidingWindowAttentionConfig, WindowKVCache

__all__ = [
    "AttentionConfig",
    "AttentionRecord",
    "AttentionRecorder",
    "KVCache",
    "LatentAttention",
    "LatentAttentionConfig",
    "LatentKVCache",
    "LayerCache",
    "MultiHeadAttention",
    "MultiHeadAttentionConfig",
    "SlidingWindowAttention",
    "SlidingWindowAttentionConfig",
    "WindowKVCache",
    "cache_length",
    "causal_mask",
    "combine_masks",
    "crop_cache",
    "new_cache",
    "padding_mask_from_ids",
    "padding_mask_from_lengths",
    "record_attention",
    "reorder_cache",
    "scaled_dot_product_attention",
    "set_absorb",
    "settled_length",
    "sliding_window_mask",
    "storage_dtype",
]
