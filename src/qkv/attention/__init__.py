"""Attention: scaled dot-product attention, masks, multi-head / grouped-query / latent attention, KV caches,
and recording the attention weights."""

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
from qkv.attention.latent import LatentAttention, LatentKVCache, set_absorb
from qkv.attention.masks import (
    causal_mask,
    combine_masks,
    padding_mask_from_ids,
    padding_mask_from_lengths,
    sliding_window_mask,
)
from qkv.attention.multi_head import MultiHeadAttention
from qkv.attention.record import AttentionRecord, AttentionRecorder, record_attention
from qkv.attention.sdpa import scaled_dot_product_attention

__all__ = [
    "AttentionRecord",
    "AttentionRecorder",
    "KVCache",
    "LatentAttention",
    "LatentKVCache",
    "LayerCache",
    "MultiHeadAttention",
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
