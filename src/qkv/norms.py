"""Normalisation layers: LayerNorm, RMSNorm, and BatchNorm for comparison.

LayerNorm normalises each token over its features: y = (x − mean) / √(var + ε) · γ + β, with the
biased variance (divide by d, not d − 1) and ε inside the square root.
RMSNorm (Zhang & Sennrich) drops the centring and the shift: y = x / √(mean(x²) + ε) · γ.
BatchNorm normalises each feature over the batch and time instead, so a token's output depends
on the other sequences in the batch, which is why Transformers do not use it (`qkv lab norms`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from qkv.config import Config
from qkv.errors import QkvError

NormKind = Literal["layer", "rms", "batch"]


@dataclass(frozen=True, kw_only=True)
class NormConfig(Config):
    """Which norm, its ε, and whether LayerNorm has a shift β."""

    kind: NormKind = "layer"  # type: ignore[misc]  # a field here: every norm has the same settings
    eps: float = 1e-5
    bias: bool = True

    def check(self) -> None:
        """ε must be positive."""
        if self.eps <= 0:
            raise QkvError(f"norm eps must be positive, got {self.eps}")

    def build(self, d_model: int) -> nn.Module:
        """The norm over d_model features."""
        return make_norm(self.kind, d_model, self.eps, self.bias)


class LayerNorm(nn.Module):
    """LayerNorm over the last dim, with optional bias (β)."""

    def __init__(self, d_model: int, eps: float = 1e-5, bias: bool = True) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d_model))
        self.bias = nn.Parameter(torch.zeros(d_model)) if bias else None

    def reset_parameters(self) -> None:
        """γ = 1, β = 0 (in place; also what materialises a model built on the meta device)."""
        with torch.no_grad():
            self.weight.fill_(1.0)
            if self.bias is not None:
                self.bias.zero_()

    def forward(self, x: Tensor) -> Tensor:
        """(..., d) → (..., d); F.layer_norm computes exactly the formula in the module docstring."""
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, self.eps)


class RMSNorm(nn.Module):
    """RMSNorm: learnable scale γ, no shift, no centring."""

    def __init__(self, d_model: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d_model))

    def reset_parameters(self) -> None:
        """γ = 1 (in place)."""
        with torch.no_grad():
            self.weight.fill_(1.0)

    def forward(self, x: Tensor) -> Tensor:
        """(..., d) → (..., d), computed in float32 for stability under bf16/fp16."""
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return normed.to(x.dtype) * self.weight


class BatchNorm(nn.Module):
    """BatchNorm1d applied to (B, T, d) activations: each feature normalised over batch and time."""

    def __init__(self, d_model: int, eps: float = 1e-5, momentum: float = 0.1) -> None:
        super().__init__()
        self.norm = nn.BatchNorm1d(d_model, eps=eps, momentum=momentum)

    def forward(self, x: Tensor) -> Tensor:
        """(B, T, d) → (B, T, d); statistics over the B·T tokens in training, running ones in eval."""
        if x.dim() != 3:
            raise QkvError(f"BatchNorm expects (B, T, d) activations, got shape {tuple(x.shape)}")
        return self.norm(x.transpose(1, 2)).transpose(1, 2)


def make_norm(kind: NormKind, d_model: int, eps: float, bias: bool = True) -> nn.Module:
    """Build the norm named by a config's `norm` field."""
    if kind == "layer":
        return LayerNorm(d_model, eps=eps, bias=bias)
    if kind == "rms":
        return RMSNorm(d_model, eps=eps)
    if kind == "batch":
        return BatchNorm(d_model, eps=eps)
    raise QkvError(f"unknown norm {kind!r}; choose one of: layer, rms, batch")
