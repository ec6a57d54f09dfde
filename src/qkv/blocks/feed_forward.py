"""The position-wise feed-forward network: FFN(x) = W_2 · act(W_1 x + b_1) + b_2.

Applied to every token independently (a 1×1 convolution over time); it is where most of a
Transformer's parameters live (2 · d_model · d_ff per layer, vs 4 · d_model² for attention).
SwiGLU (Shazeer 2020) gates the hidden layer: W_2 (silu(W_gate x) ⊙ W_1 x). Plain SiLU (swish, x · σ(x),
Marian's activation) has no gate: W_2 silu(W_1 x).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

import torch.nn.functional as F
from torch import Tensor, nn

from qkv.blocks.dropout import Dropout
from qkv.config import Config, probability
from qkv.errors import QkvError

Activation = Literal["relu", "gelu", "gelu_tanh", "swiglu", "silu"]


@dataclass(frozen=True, kw_only=True)
class FeedForwardConfig(Config):
    """A dense position-wise feed-forward layer (kind "dense"); qkv.blocks.moe adds the mixture of experts."""

    variants: ClassVar[dict[str, type[Config]] | None] = {}
    kind: ClassVar[str] = "dense"

    # None = 4 · d_model, or ⌈8/3 · d_model⌉ rounded up to a multiple of 8 for SwiGLU (its three matrices then hold
    # as many parameters as two of 4 · d_model); 0 = no feed-forward layer (attention-only blocks)
    d_ff: int | None = None
    activation: Activation = "relu"
    bias: bool = True
    dropout: float = 0.1  # on the hidden layer while training

    def check(self) -> None:
        """A width ≥ 0 and a dropout probability."""
        if self.d_ff is not None and self.d_ff < 0:
            raise QkvError(f"d_ff must be an integer ≥ 0 (0 = attention-only layers), got {self.d_ff!r}")
        probability(self, "dropout")

    def width(self, d_model: int) -> int:
        """The hidden width: d_ff, or its default for d_model and the activation."""
        if self.d_ff is not None:
            return self.d_ff
        return 4 * d_model if self.activation != "swiglu" else -(-8 * d_model // 24) * 8

    def build(self, d_model: int) -> nn.Module | None:
        """The feed-forward layer over width d_model; None for d_ff = 0."""
        width = self.width(d_model)
        return FeedForward(d_model, width, self.activation, self.dropout, self.bias) if width else None


FeedForwardConfig.register(FeedForwardConfig)


class FeedForward(nn.Module):
    """Linear d_model → d_ff, activation (ReLU, GELU, SiLU or SwiGLU), dropout, Linear d_ff → d_model."""

    def __init__(
        self, d_model: int, d_ff: int, activation: str = "relu", dropout: float = 0.0, bias: bool = True
    ) -> None:
        super().__init__()
        if activation not in ("relu", "gelu", "gelu_tanh", "swiglu", "silu"):
            raise QkvError(f"unknown activation {activation!r}; choose one of: relu, gelu, gelu_tanh, swiglu, silu")
        self.activation = activation
        self.up = nn.Linear(d_model, d_ff, bias=bias)  # W_1
        self.gate = nn.Linear(d_model, d_ff, bias=bias) if activation == "swiglu" else None
        self.down = nn.Linear(d_ff, d_model, bias=bias)  # W_2
        self.dropout = Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        """(..., d_model) → (..., d_model)."""
        hidden = self.up(x)  # (..., d_ff)
        if self.gate is not None:
            hidden = F.silu(self.gate(x)) * hidden
        elif self.activation == "relu":
            hidden = F.relu(hidden)
        elif self.activation == "gelu":
            hidden = F.gelu(hidden)
        elif self.activation == "silu":
            hidden = F.silu(hidden)
        else:
            hidden = F.gelu(hidden, approximate="tanh")  # GPT-2's "gelu_new"
        return self.down(self.dropout(hidden))
