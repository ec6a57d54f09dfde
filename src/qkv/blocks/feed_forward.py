"""The position-wise feed-forward network: FFN(x) = W_2 · act(W_1 x + b_1) + b_2.

Applied to every token independently (a 1×1 convolution over time); it is where most of a
Transformer's parameters live (2 · d_model · d_ff per layer, vs 4 · d_model² for attention).
SwiGLU (Shazeer 2020) gates the hidden layer: W_2 (silu(W_gate x) ⊙ W_1 x). Plain SiLU (swish, x · σ(x),
Marian's activation) has no gate: W_2 silu(W_1 x).
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn

from qkv.blocks.dropout import Dropout
from qkv.errors import QkvError


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
