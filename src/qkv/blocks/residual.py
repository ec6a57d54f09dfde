"""Residual connection with normalisation, in the two placements.

post-norm (the paper):  x = Norm(x + Dropout(Sublayer(x)))
pre-norm (GPT-2 on):    x = x + Dropout(Sublayer(Norm(x)))

Pre-norm keeps an un-normalised path from input to output, so gradients reach early layers
undiminished and deep stacks train without a long warmup; it needs a final norm after the stack.
"""

from __future__ import annotations

from torch import Tensor, nn

from qkv.blocks.dropout import Dropout
from qkv.norms import NormConfig


class ResidualNorm(nn.Module):
    """The norm and dropout around one sublayer; `before` feeds the sublayer, calling the module adds it back.

    The sum is the module's forward, so a forward hook sees the residual stream after each sublayer
    (qkv.interpret names it resid_mid).
    """

    def __init__(self, d_model: int, norm: NormConfig, pre_norm: bool, dropout: float) -> None:
        super().__init__()
        self.pre_norm = pre_norm
        self.norm = norm.build(d_model)
        self.dropout = Dropout(dropout)

    def before(self, x: Tensor) -> Tensor:
        """The sublayer's input: Norm(x) for pre-norm, x itself for post-norm."""
        return self.norm(x) if self.pre_norm else x

    def forward(self, x: Tensor, sublayer_out: Tensor) -> Tensor:
        """The residual sum, normalised after the addition for post-norm."""
        x = x + self.dropout(sublayer_out)
        return x if self.pre_norm else self.norm(x)
