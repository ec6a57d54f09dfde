"""Scaled dot-product attention: Attention(Q, K, V) = softmax(Q Kᵀ / √d_k) V.

Why the 1/√d_k scale: if the components of q and k are independent with mean 0 and variance 1,
then q·k = Σᵢ qᵢkᵢ is a sum of d_k terms of variance 1, so its variance is d_k. Large scores push
the softmax into saturation (one-hot output, vanishing gradient). Dividing by √d_k brings the
variance back to 1 whatever the head size (`qkv lab variance` measures this).

The function below is the formula, step by step. PyTorch's fused kernels compute the same numbers
without materialising the (T_q, T_k) weights; qkv.attention.kernels sends each call to one of them,
behind this same call, unless the weights are being recorded (`record_attention`) or the reference is
asked for. Tests hold the two paths to 1e-5 in fp32.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor

from qkv.attention import kernels
from qkv.attention.masks import visible_mask
from qkv.attention.record import active_recorder

Backend = Literal["auto", "reference", "fused"]


def scaled_dot_product_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Tensor | None = None,
    causal: bool = False,
    scale: float | None = None,
    dropout_p: float = 0.0,
    backend: Backend = "auto",
    kv_groups: int = 1,
) -> Tensor:
    """softmax(q kᵀ · scale) v for q (..., T_q, d_k), k (..., T_k, d_k), v (..., T_k, d_v).

    mask: boolean, True = may attend, broadcastable to (..., T_q, T_k).
    causal: query i sees keys j ≤ i + (T_k − T_q), i.e. the triangle is aligned to the end of the
        keys, as when the keys hold a KV cache followed by the new queries.
    scale: defaults to 1/√d_k; 1.0 gives the unscaled dot product.
    backend: "auto" (a fused kernel unless attention is being recorded), "reference" or "fused".
    kv_groups: grouped-query attention, q (B, H, T_q, d_k) with k, v (B, H / kv_groups, T_k, d): each key/value
        head serves kv_groups consecutive query heads.
    Returns the context vectors (..., T_q, d_v). To see the weights, run it inside `record_attention()`.
    A query whose keys are all masked gets a zero output (and zero gradient), never NaN.
    """
    if kernels.use_fused(backend):
        return kernels.fused_attention(q, k, v, mask, causal, scale, dropout_p, kv_groups)
    k, v = kernels.repeat_kv(q, k, v, kv_groups)  # (..., H, T_k, d): one key/value head per query head
    kernels.check_inputs(q, k, v, mask)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    attn_scores = (q @ k.transpose(-2, -1)) * scale  # (..., T_q, T_k)
    mask, row_visible = visible_mask(mask, causal, q.shape[-2], k.shape[-2], q.device)
    if mask is not None:
        # -inf makes exp() exactly 0; every row has a visible key here, so no NaN can appear.
        attn_scores = attn_scores.masked_fill(~mask, float("-inf"))
    attn_weights = torch.softmax(attn_scores, dim=-1)  # rows sum to 1
    if row_visible is not None:
        attn_weights = attn_weights * row_visible  # a query that sees no key attends to nothing
    recorder = active_recorder()
    if recorder is not None:
        recorder.add(attn_scores, attn_weights)
    if dropout_p > 0.0:
        attn_weights = F.dropout(attn_weights, p=dropout_p)
    return attn_weights @ v  # (..., T_q, d_v): each query's weighted mix of the values
