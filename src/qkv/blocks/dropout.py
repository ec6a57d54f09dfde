"""Dropout (Srivastava et al., 2014): zero each activation with probability p while training, scale the
rest by 1 / (1 − p) so the expected value is unchanged; at inference it is the identity.

On the CPU, PyTorch draws one 32-bit random number per element (bernoulli_), and that costs about as much
as a matmul of the same tensor (benchmarks/dropout.py; docs/speed.md has the figures). Here one 64-bit draw
gives the masks of four elements: its four 16-bit words, each compared
with p on 16 bits. The keep probability is then 1 − round(p · 2¹⁶) / 2¹⁶ (within 7.7e-6 of 1 − p), and
the scale uses that exact value. On GPUs PyTorch's fused kernel is already fast and is used as it is, and
under torch.compile the compiler generates the masks inside its fused kernels.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from qkv.errors import QkvError

_LEVELS = 1 << 16  # a 16-bit word takes 2¹⁶ equally likely values


def _threshold(p: float) -> int:
    """How many of the 2¹⁶ word values drop an element (at most all but one, so the scale stays finite)."""
    return min(round(p * _LEVELS), _LEVELS - 1)


def keep_mask(shape: torch.Size, p: float, device: torch.device) -> Tensor:
    """A boolean mask of `shape`, each entry True with probability 1 − round(p · 2¹⁶) / 2¹⁶."""
    n = shape.numel()
    words = torch.empty((n + 3) // 4, dtype=torch.int64, device=device).random_(-(2**63), None)  # all 64 bits
    return words.view(torch.int16)[:n].view(shape) >= _threshold(p) - _LEVELS // 2  # int16 is [−2¹⁵, 2¹⁵)


class _Masked(torch.autograd.Function):
    """x · mask · scale, with the same (boolean) mask applied to the gradient."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, x: Tensor, keep: Tensor, scale: float) -> Tensor:
        ctx.save_for_backward(keep)
        ctx.scale = scale  # type: ignore[attr-defined]
        return torch.where(keep, x * scale, 0.0)

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: Tensor) -> tuple[Tensor, None, None]:
        (keep,) = ctx.saved_tensors  # type: ignore[attr-defined]
        return torch.where(keep, grad * ctx.scale, 0.0), None, None  # type: ignore[attr-defined]


def _check_p(p: float) -> None:
    """Refuse a drop probability outside [0, 1)."""
    if not 0.0 <= p < 1.0:
        raise QkvError(f"dropout must be in [0, 1), got {p}")


def dropout(x: Tensor, p: float, training: bool = True) -> Tensor:
    """Inverted dropout; on CPU with the cheap 16-bit masks, elsewhere PyTorch's own kernel."""
    _check_p(p)
    if not training or p == 0.0:
        return x
    if x.device.type != "cpu" or torch.compiler.is_compiling():  # a compiled graph fuses its own random masks
        return F.dropout(x, p, training=True)
    return _Masked.apply(x, keep_mask(x.shape, p, x.device), _LEVELS / (_LEVELS - _threshold(p)))


class Dropout(nn.Module):
    """A drop-in for nn.Dropout (same `p`, same train/eval behaviour) with the cheap CPU masks."""

    def __init__(self, p: float = 0.5) -> None:
        super().__init__()
        _check_p(p)
        self.p = p

    def forward(self, x: Tensor) -> Tensor:
        """x with each element zeroed with probability p (training only), the rest scaled by 1 / (1 − p)."""
        return dropout(x, self.p, self.training)

    def extra_repr(self) -> str:
        """Shown by print(model)."""
        return f"p={self.p}"
