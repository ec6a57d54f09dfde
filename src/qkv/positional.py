"""Where a token is: attention itself is permutation-equivariant, so order must be injected.

Three ways, all in this room:
- sinusoidal (the paper): PE(pos, 2i) = sin(pos / 10000^(2i/d)), PE(pos, 2i+1) = cos(pos / 10000^(2i/d)),
  added to the token embeddings. For every offset k, PE(pos + k) is a fixed rotation of PE(pos)
  (one 2×2 rotation per sin/cos pair), which is why the paper hoped it would let attention
  reason about relative positions. Marian (OPUS-MT) and fairseq put all the sines first and all the
  cosines after them ([sin | cos], layout="halves"): the same numbers in another order of dimensions.
- learned absolute positions (GPT-2, BERT): one trainable vector per position.
- rotary (RoPE, Su et al.): no addition at all; q and k are rotated pair-wise by an angle
  proportional to their position, so q·k depends only on the relative offset.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar, Literal

import torch
from torch import Tensor, nn

from qkv.config import Config
from qkv.errors import QkvError

SinusoidLayout = Literal["interleaved", "halves"]


def sinusoidal_table(max_len: int, d_model: int, layout: SinusoidLayout = "interleaved") -> Tensor:
    """(max_len, d_model) table of the paper's sinusoidal encodings (float32), sin/cos interleaved or in halves."""
    if d_model % 2 != 0:
        raise QkvError(f"sinusoidal positions need an even d_model, got {d_model}")
    if layout not in ("interleaved", "halves"):
        raise QkvError(f"unknown sinusoid layout {layout!r}; choose one of: interleaved, halves")
    position = torch.arange(max_len, dtype=torch.float64)[:, None]  # (L, 1)
    # 10000^(-2i/d) for i = 0 .. d/2 − 1, computed in float64 so large positions stay exact.
    inv_freq = torch.exp(torch.arange(0, d_model, 2, dtype=torch.float64) * (-math.log(10000.0) / d_model))
    angles = position * inv_freq  # (L, d/2)
    if layout == "halves":  # PE(pos, i) = sin, PE(pos, d/2 + i) = cos of the same angle
        return torch.cat([torch.sin(angles), torch.cos(angles)], dim=1).float()
    table = torch.empty(max_len, d_model, dtype=torch.float64)
    table[:, 0::2] = torch.sin(angles)
    table[:, 1::2] = torch.cos(angles)
    return table.float()


def check_length(start: int, length: int, max_len: int) -> None:
    """Refuse positions past the table instead of silently indexing out of range."""
    if start + length > max_len:
        raise QkvError(
            f"sequence reaches position {start + length} but the model has max_positions={max_len}; "
            "shorten the input or raise max_positions"
        )


def check_positions(positions: Tensor, max_len: int) -> None:
    """Refuse arbitrary positions (B, T) past the table. Not inside a compiled graph, where reading a tensor's value
    would split the graph: the engine's slots, which compile their step, never hold more than the model's context."""
    if positions.numel() and not torch.compiler.is_compiling():
        check_length(int(positions.max()), 1, max_len)


class SinusoidalPositionalEncoding(nn.Module):
    """Adds nothing trainable: returns rows of the fixed sinusoidal table, computed once."""

    table: Tensor

    def __init__(self, d_model: int, max_len: int, layout: SinusoidLayout = "interleaved") -> None:
        super().__init__()
        self.max_len, self.d_model, self.layout = max_len, d_model, layout
        # Not persistent: it is a pure function of the config, so checkpoints need not carry it.
        self.register_buffer("table", sinusoidal_table(max_len, d_model, layout), persistent=False)

    def reset_parameters(self) -> None:
        """Recompute the table in place (what materialises a model built on the meta device)."""
        self.table.copy_(sinusoidal_table(self.max_len, self.d_model, self.layout))

    def forward(self, length: int, start: int = 0) -> Tensor:
        """(length, d_model) encodings of positions start .. start + length − 1."""
        check_length(start, length, self.max_len)
        return self.table[start : start + length]

    def at(self, positions: Tensor) -> Tensor:
        """(B, T, d_model) encodings of arbitrary positions (B, T)."""
        check_positions(positions, self.max_len)
        return self.table[positions]


class LearnedPositionalEmbedding(nn.Module):
    """One trainable d_model vector per absolute position (GPT-2, BERT)."""

    def __init__(self, d_model: int, max_len: int) -> None:
        super().__init__()
        self.max_len = max_len
        self.weight = nn.Parameter(torch.zeros(max_len, d_model))
        nn.init.normal_(self.weight, std=0.02)

    def forward(self, length: int, start: int = 0) -> Tensor:
        """(length, d_model) embeddings of positions start .. start + length − 1."""
        check_length(start, length, self.max_len)
        return self.weight[start : start + length]

    def at(self, positions: Tensor) -> Tensor:
        """(B, T, d_model) embeddings of arbitrary positions (B, T)."""
        check_positions(positions, self.max_len)
        return self.weight[positions]


class RotaryEmbedding(nn.Module):
    """cos/sin tables for RoPE; `apply_rotary` rotates q and k with them.

    Uses the "rotate half" pairing (dimension i with i + d/2), as GPT-NeoX and Llama do, so
    checkpoints of those families load without permuting weights.
    """

    cos_table: Tensor
    sin_table: Tensor

    def __init__(self, head_dim: int, max_len: int, base: float = 10000.0) -> None:
        super().__init__()
        if head_dim % 2 != 0:
            raise QkvError(f"rotary positions need an even head dim, got {head_dim}")
        self.max_len, self.head_dim, self.base = max_len, head_dim, base
        cos, sin = self._tables()
        self.register_buffer("cos_table", cos, persistent=False)
        self.register_buffer("sin_table", sin, persistent=False)

    def _tables(self) -> tuple[Tensor, Tensor]:
        """(cos, sin), each (max_len, head_dim), computed in float64 on the CPU and stored in float32 on the default
        device (on the meta device, arithmetic would import torch's compiler)."""
        dims = torch.arange(0, self.head_dim, 2, dtype=torch.float64, device="cpu")
        inv_freq = 1.0 / (self.base ** (dims / self.head_dim))  # (D/2,)
        angles = torch.arange(self.max_len, dtype=torch.float64, device="cpu")[:, None] * inv_freq  # (L, D/2)
        angles = torch.cat([angles, angles], dim=-1)  # (L, D): both halves share a frequency
        device = torch.get_default_device()
        return angles.cos().float().to(device), angles.sin().float().to(device)

    def reset_parameters(self) -> None:
        """Recompute the tables in place (what materialises a model built on the meta device)."""
        cos, sin = self._tables()
        self.cos_table.copy_(cos)
        self.sin_table.copy_(sin)

    def forward(self, length: int, start: int = 0) -> tuple[Tensor, Tensor]:
        """(cos, sin), each (length, head_dim), for positions start .. start + length − 1."""
        check_length(start, length, self.max_len)
        return self.cos_table[start : start + length], self.sin_table[start : start + length]

    def at(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """(cos, sin), each (B, 1, T, head_dim), for arbitrary positions (B, T): they broadcast over heads."""
        check_positions(positions, self.max_len)
        return self.cos_table[positions][:, None], self.sin_table[positions][:, None]


def rotate_half(x: Tensor) -> Tensor:
    """(x1, x2) → (−x2, x1) on the two halves of the last dim: a 90° turn of every pair."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate x (..., T, D) by the per-position angles: x·cos + rotate_half(x)·sin."""
    return x * cos.to(x.dtype) + rotate_half(x) * sin.to(x.dtype)


@dataclass(frozen=True, kw_only=True)
class PositionsConfig(Config):
    """How a model knows where each token is: one of the kinds below."""

    variants: ClassVar[dict[str, type[Config]] | None] = {}

    def build(self, d_model: int, max_positions: int, rotary_dim: int) -> nn.Module | None:
        """The module that gives positions (added to the embeddings, or RoPE's tables); None for none."""
        return None


@PositionsConfig.register
@dataclass(frozen=True, kw_only=True)
class LearnedPositionsConfig(PositionsConfig):
    """One trained vector per position (GPT-2, BERT); `offset` rows come first that no position uses (BART's 2)."""

    kind: ClassVar[str] = "learned"
    offset: int = 0

    def check(self) -> None:
        """The offset is a row count."""
        if self.offset < 0:
            raise QkvError(f"positions offset must be ≥ 0, got {self.offset}")

    def build(self, d_model: int, max_positions: int, rotary_dim: int) -> LearnedPositionalEmbedding:
        """A table of max_positions + offset rows."""
        return LearnedPositionalEmbedding(d_model, max_positions + self.offset)


@PositionsConfig.register
@dataclass(frozen=True, kw_only=True)
class SinusoidalPositionsConfig(PositionsConfig):
    """The paper's fixed sinusoids, sin/cos interleaved (the paper) or in halves (Marian, fairseq)."""

    kind: ClassVar[str] = "sinusoidal"
    layout: SinusoidLayout = "interleaved"

    def build(self, d_model: int, max_positions: int, rotary_dim: int) -> SinusoidalPositionalEncoding:
        """The table of max_positions rows."""
        if d_model % 2:
            raise QkvError(f"sinusoidal positions need an even d_model, got {d_model}")
        return SinusoidalPositionalEncoding(d_model, max_positions, self.layout)


@PositionsConfig.register
@dataclass(frozen=True, kw_only=True)
class RotaryPositionsConfig(PositionsConfig):
    """RoPE: queries and keys rotated by their position, with frequencies base^(−2i/d)."""

    kind: ClassVar[str] = "rotary"
    base: float = 10000.0

    def check(self) -> None:
        """The base must be positive."""
        if self.base <= 0:
            raise QkvError(f"rotary base must be positive, got {self.base}")

    def build(self, d_model: int, max_positions: int, rotary_dim: int) -> RotaryEmbedding:
        """cos/sin tables over the rotated dims of a head."""
        return RotaryEmbedding(rotary_dim, max_positions, base=self.base)


@PositionsConfig.register
@dataclass(frozen=True, kw_only=True)
class NoPositionsConfig(PositionsConfig):
    """No positions at all (a causal decoder can still infer them; the lab compares)."""

    kind: ClassVar[str] = "none"
