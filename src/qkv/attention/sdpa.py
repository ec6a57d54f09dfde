"""Scaled dot-product attention: Attention(Q, K, V) = softmax(Q Kᵀ / √d_k) V.

Why the 1/√d_k scale: if the components of q and k are independent with mean 0 and variance 1,
then q·k = Σᵢ qᵢkᵢ is a sum of d_k terms of variance 1, so its variance is d_k. Large scores push
the softmax into saturation (one-hot output, vanishing gradient). Dividing by √d_k brings the
variance back to 1 whatever the head size (`qkv lab variance` measures this).

Two paths sit behind one function:
- the *reference* path spells the formula out (scores → mask → softmax → weights @ V); inside
  `record_attention()` it is the path taken, and it hands the scores and weights to the recorder;
- the *fused* path calls `torch.nn.functional.scaled_dot_product_attention`, which never
  materialises the (T_q, T_k) weight matrix on its memory-efficient kernels.
They compute the same numbers; tests hold them to 1e-5 in fp32.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor

from qkv.attention.masks import causal_mask
from qkv.attention.record import active_recorder
from qkv.errors import QkvError

Backend = Literal["auto", "reference", "fused"]


_HAS_GQA = tuple(int(part) for part in torch.__version__.split(".")[:2]) >= (2, 5)  # enable_gqa arrived in 2.5

def _broadcast(*shapes: Sequence[int]) -> tuple[int, ...] | None:
    """NumPy broadcasting of shapes, or None if they do not broadcast.

    Plain Python on purpose: torch.broadcast_shapes imports sympy on first use (≈ 0.4 s per process).
    """
    ndim = max(len(s) for s in shapes)
    result = []
    for dims in zip(*[(1,) * (ndim - len(s)) + tuple(s) for s in shapes], strict=True):
        size = 1
        for d in dims:  # comparisons only, no set of sizes: under torch.compile a size may be symbolic
            if d != 1:
                if size != 1 and d != size:
                    return None
                size = d
        result.append(size)
    return tuple(result)


def _check_inputs(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None) -> None:
    """Raise a QkvError naming the offending dimension when q, k, v or mask do not fit together."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() < 2:
            raise QkvError(f"{name} must have shape (..., T, d) with at least 2 dims, got shape {tuple(t.shape)}")
    if q.shape[-1] != k.shape[-1]:
        raise QkvError(f"q and k must share the last dim d_k: q has d_k={q.shape[-1]}, k has d_k={k.shape[-1]}")
    if k.shape[-2] != v.shape[-2]:
        raise QkvError(f"k and v must have the same number of keys T_k: k has {k.shape[-2]}, v has {v.shape[-2]}")
    if not (q.dtype == k.dtype == v.dtype):
        raise QkvError(f"q, k, v must share a dtype, got q={q.dtype}, k={k.dtype}, v={v.dtype}")
    if not (q.device == k.device == v.device):
        raise QkvError(f"q, k, v must be on one device, got q={q.device}, k={k.device}, v={v.device}")
    leads = (q.shape[:-2], k.shape[:-2], v.shape[:-2])
    if not leads[0] == leads[1] == leads[2] and _broadcast(*leads) is None:
        raise QkvError(
            f"leading (batch/head) dims do not broadcast: q {tuple(q.shape[:-2])}, "
            f"k {tuple(k.shape[:-2])}, v {tuple(v.shape[:-2])}"
        )
    if mask is None:
        return
    if mask.dtype != torch.bool:
        raise QkvError(f"mask must be boolean (True = may attend), got dtype {mask.dtype}")
    if mask.device != q.device:
        raise QkvError(f"mask is on {mask.device} but q is on {q.device}")
    t_q, t_k = q.shape[-2], k.shape[-2]
    if mask.dim() < 2 or mask.shape[-2] not in (1, t_q) or mask.shape[-1] not in (1, t_k):
        raise QkvError(f"mask of shape {tuple(mask.shape)} does not broadcast to (..., T_q={t_q}, T_k={t_k})")
    if _broadcast(mask.shape[:-2], q.shape[:-2]) is None:
        raise QkvError(f"mask leading dims {tuple(mask.shape[:-2])} do not broadcast to q's {tuple(q.shape[:-2])}")


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
    backend: "auto" (fused unless attention is being recorded), "reference" or "fused".
    kv_groups: grouped-query attention, q (B, H, T_q, d_k) with k, v (B, H / kv_groups, T_k, d): each key/value
        head serves kv_groups consecutive query heads.
    Returns the context vectors (..., T_q, d_v). To see the weights, run it inside `record_attention()`.
    A query whose keys are all masked gets a zero output (and zero gradient), never NaN.
    """
    if kv_groups > 1:
        grouped = _grouped_kernel(q, k, v, mask, causal, scale, dropout_p, backend, kv_groups)
        if grouped is not None:
            return grouped
        k, v = k.repeat_interleave(kv_groups, dim=-3), v.repeat_interleave(kv_groups, dim=-3)  # (…, H, T_k, d)
    _check_inputs(q, k, v, mask)
    if backend not in ("auto", "reference", "fused"):
        raise QkvError(f"unknown attention backend {backend!r}; choose one of: auto, reference, fused")
    recorder = active_recorder()
    if recorder is not None and backend == "fused":
        raise QkvError("the fused backend cannot record attention weights; use backend='reference'")
    t_q, t_k = q.shape[-2], k.shape[-2]
    if scale is None:
        scale = q.shape[-1] ** -0.5
    use_reference = recorder is not None or backend == "reference"
    mask, fused_is_causal, row_visible = _combined_mask(mask, causal, t_q, t_k, use_reference, q.device)
    if not use_reference:
        context = _fused_attention(q, k, v, mask, fused_is_causal, scale, dropout_p)
        return context if row_visible is None else context * row_visible
    attn_scores, attn_weights = _reference_weights(q, k, mask, scale)
    if row_visible is not None:
        attn_weights = attn_weights * row_visible
    if recorder is not None:
        recorder.add(attn_scores, attn_weights)
    if dropout_p > 0.0:
        attn_weights = F.dropout(attn_weights, p=dropout_p)
    context = attn_weights @ v  # (..., T_q, d_v): each query's weighted mix of the values
    return context


def _combined_mask(mask: Tensor | None, causal: bool, t_q: int, t_k: int, use_reference: bool,
                   device: torch.device) -> tuple[Tensor | None, bool, Tensor | None]:  # fmt: skip
    """(mask with the causal triangle in it unless the fused causal kernel takes it, that kernel's flag, and
    which query rows see any key at all (None without a mask))."""
    if causal and t_q == 1:
        causal = False  # the single newest query sees every key: nothing to mask
    # A square causal mask alone goes to PyTorch's dedicated causal kernel; anything else is explicit.
    fused_is_causal = causal and mask is None and t_q == t_k and not use_reference
    if causal and not fused_is_causal:
        tri = causal_mask(t_q, t_k, device=device)  # (T_q, T_k)
        mask = tri if mask is None else mask & tri
    if mask is None:
        return None, fused_is_causal, None
    # A query with no visible key would take a softmax over nothing (NaN). Let it see every key,
    # then zero its output: no NaN forward or backward, and no host sync to find such rows.
    row_visible = mask.any(dim=-1, keepdim=True)  # (..., T_q, 1)
    return mask | ~row_visible, fused_is_causal, row_visible


def _grouped_kernel(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, causal: bool, scale: float | None,
                    dropout_p: float, backend: Backend, kv_groups: int) -> Tensor | None:  # fmt: skip
    """Grouped-query attention in PyTorch's kernel, which reads each key/value head once for its group (no copies
    of K and V); None where that kernel cannot serve the call (a mask, recording, an unaligned causal triangle)."""
    if q.dim() < 3 or k.dim() != q.dim() or k.shape[-3] * kv_groups != q.shape[-3]:
        raise QkvError(f"kv_groups={kv_groups} needs k, v with H / {kv_groups} heads on dim -3: q "
                       f"{tuple(q.shape)}, k {tuple(k.shape)}")  # fmt: skip
    plain = mask is None and backend != "reference" and active_recorder() is None
    if not (_HAS_GQA and plain and (not causal or q.shape[-2] in (1, k.shape[-2]))):
        return None
    _check_inputs(q, k[..., :1, :, :], v[..., :1, :, :], None)
    is_causal = causal and q.shape[-2] > 1
    return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=is_causal,
                                          scale=q.shape[-1] ** -0.5 if scale is None else scale,
                                          enable_gqa=True)  # fmt: skip


def _reference_weights(q: Tensor, k: Tensor, mask: Tensor | None, scale: float) -> tuple[Tensor, Tensor]:
    """The formula, step by step, up to the softmax: (attention scores, attention weights)."""
    attn_scores = (q @ k.transpose(-2, -1)) * scale  # (..., T_q, T_k)
    if mask is not None:
        # -inf would make exp() exactly 0; every row has a visible key here, so no NaN can appear.
        attn_scores = attn_scores.masked_fill(~mask, float("-inf"))
    attn_weights = torch.softmax(attn_scores, dim=-1)  # rows sum to 1
    return attn_scores, attn_weights


def _fused_attention(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, is_causal: bool, scale: float, dropout_p: float
) -> Tensor:
    """PyTorch's fused kernel (flash / memory-efficient / math, chosen by PyTorch)."""
    if mask is None and q.shape[:-2] == k.shape[:-2] == v.shape[:-2]:  # nothing to broadcast (every decode step)
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=is_causal, scale=scale)
    shapes = [q.shape[:-2], k.shape[:-2], v.shape[:-2]]
    if mask is not None:  # a (B, 1, 1, T_k) mask may add leading dims, as it does on the reference path
        shapes.append(mask.shape[:-2])
    lead = _broadcast(*shapes)
    assert lead is not None, "checked by _check_inputs"
    # The fused kernels want equal leading dims; expand() is a view, no copy.
    q = q.expand(*lead, *q.shape[-2:])
    k = k.expand(*lead, *k.shape[-2:])
    v = v.expand(*lead, *v.shape[-2:])
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale
    )
