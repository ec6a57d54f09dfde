"""Attention masks. Convention (PyTorch's): a boolean mask, True = this query may attend to this key.

Every helper returns a mask that broadcasts against attention scores of shape (B, H, T_q, T_k):
causal and sliding-window masks are (T_q, T_k); padding masks are (B, 1, 1, T_k) so that one row
of key validity serves every head and every query. Combine masks with `&`.
"""

from __future__ import annotations

import torch
from torch import Tensor

from qkv.errors import QkvError


def causal_mask(t_q: int, t_k: int | None = None, device: torch.device | str | None = None) -> Tensor:
    """(T_q, T_k) lower triangle aligned to the end of the keys: query i sees keys j ≤ i + T_k − T_q."""
    t_k = t_q if t_k is None else t_k
    offset = t_k - t_q  # > 0 when earlier keys come from a KV cache
    return torch.ones(t_q, t_k, dtype=torch.bool, device=device).tril(diagonal=offset)


def sliding_window_mask(
    t_q: int, window: int, t_k: int | None = None, device: torch.device | str | None = None
) -> Tensor:
    """(T_q, T_k) causal mask that also hides keys more than `window − 1` positions back."""
    if window < 1:
        raise QkvError(f"sliding window must be at least 1 token, got {window}")
    t_k = t_q if t_k is None else t_k
    offset = t_k - t_q
    q_pos = torch.arange(t_q, device=device)[:, None] + offset  # absolute position of each query
    k_pos = torch.arange(t_k, device=device)[None, :]
    return (k_pos <= q_pos) & (k_pos > q_pos - window)


def padding_mask_from_lengths(lengths: Tensor | list[int], max_len: int | None = None) -> Tensor:
    """(B, 1, 1, T) mask, True on the first `lengths[b]` (real) tokens of each sequence."""
    lengths = torch.as_tensor(lengths)
    if lengths.dim() != 1:
        raise QkvError(f"lengths must be a 1-D tensor of sequence lengths, got shape {tuple(lengths.shape)}")
    if bool((lengths < 0).any()):
        raise QkvError(f"lengths must be non-negative, got {lengths.tolist()}")
    max_len = int(lengths.max()) if max_len is None else max_len
    if bool((lengths > max_len).any()):
        raise QkvError(f"a length exceeds max_len={max_len}: {lengths.tolist()}")
    positions = torch.arange(max_len, device=lengths.device)
    return (positions[None, :] < lengths[:, None])[:, None, None, :]


def padding_mask_from_ids(ids: Tensor, pad_id: int) -> Tensor:
    """(B, 1, 1, T) mask, True where the token id (B, T) is not the padding id."""
    if ids.dim() != 2:
        raise QkvError(f"token ids must have shape (B, T), got {tuple(ids.shape)}")
    return (ids != pad_id)[:, None, None, :]


def combine_masks(*masks: Tensor | None) -> Tensor | None:
    """Logical AND of the masks given (None entries are skipped); None if all are None."""
    out: Tensor | None = None
    for m in masks:
        if m is not None:
            out = m if out is None else out & m
    return out


def visible_mask(mask: Tensor | None, causal: bool, t_q: int, t_k: int,
                 device: torch.device) -> tuple[Tensor | None, Tensor | None]:  # fmt: skip
    """The mask with the causal triangle in it, and which query rows see any key at all (None without a mask).

    A query with no visible key would take a softmax over nothing (NaN). Its row is opened to every key, and
    attention multiplies its output by row_visible (0): no NaN forward or backward, and no host sync to find it.
    """
    if causal and t_q > 1:  # the single newest query sees every key: nothing to mask
        tri = causal_mask(t_q, t_k, device=device)  # (T_q, T_k)
        mask = tri if mask is None else mask & tri
    if mask is None:
        return None, None
    row_visible = mask.any(dim=-1, keepdim=True)  # (..., T_q, 1)
    return mask | ~row_visible, row_visible
