"""The fast path behind `scaled_dot_product_attention`: PyTorch's fused kernels, and the checks of its inputs.

The kernels (flash, memory-efficient, math; PyTorch picks) compute the formula of qkv.attention.sdpa without
materialising the (T_q, T_k) weights. What is chosen here, per call:
- a square causal triangle with no other mask goes to the dedicated causal kernel; any other mask is explicit;
- grouped-query attention (kv_groups > 1) never copies the keys and values per query head. Where no mask row
  depends on the query (one new token while decoding, or a padding-only mask without causality), the group is
  folded into the query axis, (B, H, T_q, D) → (B, H_kv, G·T_q, D): one product per key/value head. Otherwise
  PyTorch's grouped kernel (enable_gqa) reads each key/value head once for its group; with a mask it cannot
  take, the heads are repeated.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from qkv.attention.masks import visible_mask
from qkv.attention.record import active_recorder
from qkv.errors import QkvError

_HAS_GQA = tuple(int(part) for part in torch.__version__.split(".")[:2]) >= (2, 5)  # enable_gqa arrived in 2.5


def use_fused(backend: str) -> bool:
    """Whether a call takes a fused kernel: backend "auto" or "fused", and no attention being recorded."""
    if backend not in ("auto", "reference", "fused"):
        raise QkvError(f"unknown attention backend {backend!r}; choose one of: auto, reference, fused")
    recording = active_recorder() is not None
    if recording and backend == "fused":
        raise QkvError("the fused backend cannot record attention weights; use backend='reference'")
    return backend != "reference" and not recording


def fused_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, causal: bool, scale: float | None,
                    dropout_p: float, kv_groups: int = 1) -> Tensor:  # fmt: skip
    """scaled_dot_product_attention's result (same arguments) from PyTorch's fused kernels."""
    if kv_groups > 1:
        _check_groups(q, k, kv_groups)
        if _foldable(q, mask, causal):
            b, h, t_q, d = q.shape
            folded = q.reshape(b, h // kv_groups, kv_groups * t_q, d)  # (B, H_kv, G·T_q, D)
            out = fused_attention(folded, k, v, mask, False, scale, dropout_p)
            return out.reshape(b, h, t_q, out.shape[-1])  # (B, H, T_q, d_v)
        if _HAS_GQA and mask is None and (not causal or q.shape[-2] in (1, k.shape[-2])):
            check_inputs(q, k[..., :1, :, :], v[..., :1, :, :], None)
            return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=causal and q.shape[-2] > 1,
                                                  scale=q.shape[-1] ** -0.5 if scale is None else scale,
                                                  enable_gqa=True)  # fmt: skip
        k, v = repeat_kv(q, k, v, kv_groups)
    check_inputs(q, k, v, mask)
    t_q, t_k = q.shape[-2], k.shape[-2]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if causal and mask is None and t_q == t_k and t_q > 1:  # the dedicated causal kernel
        return _fused(q, k, v, None, True, scale, dropout_p)
    mask, row_visible = visible_mask(mask, causal, t_q, t_k, q.device)
    out = _fused(q, k, v, mask, False, scale, dropout_p)
    return out if row_visible is None else out * row_visible


def repeat_kv(q: Tensor, k: Tensor, v: Tensor, kv_groups: int) -> tuple[Tensor, Tensor]:
    """k, v (B, H_kv, T_k, d) with each head repeated for its kv_groups query heads: (B, H, T_k, d)."""
    if kv_groups == 1:
        return k, v
    _check_groups(q, k, kv_groups)
    return k.repeat_interleave(kv_groups, dim=-3), v.repeat_interleave(kv_groups, dim=-3)


def _foldable(q: Tensor, mask: Tensor | None, causal: bool) -> bool:
    """Whether every query head of a group sees the same keys under the same mask, so the group can be folded into
    the query axis: one new token, or no causality and a mask that does not depend on the query or the head."""
    t_q = q.shape[-2]
    same_rows = t_q == 1 or (not causal and (mask is None or mask.shape[-2] == 1))
    same_heads = mask is None or mask.dim() < 3 or mask.shape[-3] == 1
    return q.dim() == 4 and same_rows and same_heads


def _check_groups(q: Tensor, k: Tensor, kv_groups: int) -> None:
    """Refuse k, v whose head count times kv_groups is not q's."""
    if q.dim() < 3 or k.dim() != q.dim() or k.shape[-3] * kv_groups != q.shape[-3]:
        raise QkvError(f"kv_groups={kv_groups} needs k, v with H / {kv_groups} heads on dim -3: q "
                       f"{tuple(q.shape)}, k {tuple(k.shape)}")  # fmt: skip


def _fused(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, is_causal: bool, scale: float,
           dropout_p: float) -> Tensor:  # fmt: skip
    """PyTorch's fused kernel (flash / memory-efficient / math, chosen by PyTorch)."""
    if mask is None and q.shape[:-2] == k.shape[:-2] == v.shape[:-2]:  # nothing to broadcast (every decode step)
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=is_causal, scale=scale)
    shapes = [q.shape[:-2], k.shape[:-2], v.shape[:-2]]
    if mask is not None:  # a (B, 1, 1, T_k) mask may add leading dims, as it does on the reference path
        shapes.append(mask.shape[:-2])
    lead = _broadcast(*shapes)
    assert lead is not None, "checked by check_inputs"
    # The fused kernels want equal leading dims; expand() is a view, no copy.
    q, k, v = (t.expand(*lead, *t.shape[-2:]) for t in (q, k, v))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=is_causal,
                                          scale=scale)  # fmt: skip


def _broadcast(*shapes: Sequence[int]) -> tuple[int, ...] | None:
    """NumPy broadcasting of shapes, or None if they do not broadcast.

    Plain Python on purpose: torch.broadcast_shapes imports sympy on first use, a pause in every process.
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


def check_inputs(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None) -> None:
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
        raise QkvError(f"leading (batch/head) dims do not broadcast: q {tuple(q.shape[:-2])}, "
                       f"k {tuple(k.shape[:-2])}, v {tuple(v.shape[:-2])}")  # fmt: skip
    if mask is not None:
        _check_mask(q, k, mask)


def _check_mask(q: Tensor, k: Tensor, mask: Tensor) -> None:
    """Refuse a mask that is not boolean, on another device, or not broadcastable to (..., T_q, T_k)."""
    if mask.dtype != torch.bool:
        raise QkvError(f"mask must be boolean (True = may attend), got dtype {mask.dtype}")
    if mask.device != q.device:
        raise QkvError(f"mask is on {mask.device} but q is on {q.device}")
    t_q, t_k = q.shape[-2], k.shape[-2]
    if mask.dim() < 2 or mask.shape[-2] not in (1, t_q) or mask.shape[-1] not in (1, t_k):
        raise QkvError(f"mask of shape {tuple(mask.shape)} does not broadcast to (..., T_q={t_q}, T_k={t_k})")
    if _broadcast(mask.shape[:-2], q.shape[:-2]) is None:
        raise QkvError(f"mask leading dims {tuple(mask.shape[:-2])} do not broadcast to q's {tuple(q.shape[:-2])}")
