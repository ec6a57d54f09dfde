"""Masks, seen in the attention weights they produce (qkv.scaled_dot_product_attention's own).

A causal mask hides the future: query i may only attend to keys j ≤ i, so the weight matrix is
lower-triangular and every row still sums to 1 (the softmax renormalises over what is visible).
A padding mask hides the filler tokens that make sequences of different lengths fit one tensor:
no query puts weight on them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from qkv.attention import causal_mask, padding_mask_from_lengths, record_attention, scaled_dot_product_attention
from qkv.errors import QkvError
from qkv.lab.plotting import Margins, Section, format_table, heatmap, new_figure, save

if TYPE_CHECKING:
    from matplotlib.figure import Figure

TITLE = "Causal and padding masks"
EXPLANATION = (
    "Masks decide which keys each query may see; the softmax then spreads each row's weight over the visible "
    "keys only. The causal mask of a decoder leaves a lower-triangular weight matrix: zeros above the diagonal "
    "(no peeking at later tokens) and rows that still sum to 1. The padding mask of a batch of unequal "
    "sequences zeroes the columns of the padding tokens, so filler never leaks into real tokens; a decoder "
    "over a padded batch combines the two. The images are real weights from qkv.scaled_dot_product_attention "
    "on random queries and keys."
)
TOKENS = ("<s>", "the", "cat", "sat", "on", "mats")


@dataclass
class MasksResult:
    """Masks and the attention weights they produce, with the checks that define them."""

    tokens: list[str]  # labels of the T positions
    length: int  # real tokens in the padded sequence; the rest are padding
    causal_mask: np.ndarray  # (T, T) bool, True = may attend
    padding_mask: np.ndarray  # (T, T) bool (one key-validity row, repeated for every query)
    causal_weights: np.ndarray  # (T, T)
    padding_weights: np.ndarray  # (T, T)
    combined_weights: np.ndarray  # (T, T) causal and padding together
    max_above_diagonal: float  # largest causal weight above the diagonal (0)
    max_on_padding: float  # largest weight any query puts on a padding key (0)
    max_row_sum_error: float  # max |row sum − 1| over all three matrices

    def table(self) -> str:
        """The checks, then the causal weight matrix itself."""
        checks = format_table(
            ["check", "value", "expected"],
            [
                ["largest causal weight above the diagonal", self.max_above_diagonal, "0"],
                ["largest weight on a padding key", self.max_on_padding, "0"],
                ["max |row sum − 1| (all matrices)", self.max_row_sum_error, "0 (to float precision)"],
            ],
            title=f"T = {len(self.tokens)} tokens; the padded sequence has {self.length} real tokens",
        )
        rows = [[t, *(f"{x:.4f}" for x in w)] for t, w in zip(self.tokens, self.causal_weights, strict=True)]
        causal = format_table(["query \\ key", *self.tokens], rows, title="causal attention weights")
        return f"{checks}\n\n{causal}"

    def __str__(self) -> str:
        """Same as table()."""
        return self.table()


def masks(tokens: Sequence[str] = TOKENS, length: int = 4, d_k: int = 8, seed: int = 0) -> MasksResult:
    """Attention weights under a causal mask, a padding mask (first `length` tokens real), and both."""
    t = len(tokens)
    if t < 2 or not 1 <= length <= t:
        raise QkvError(f"need at least 2 tokens and 1 ≤ length ≤ {t}, got {t} tokens and length={length}")
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, t, d_k, generator=gen) for _ in range(3))
    causal = causal_mask(t)  # (T, T)
    padding = padding_mask_from_lengths([length], t)[0, 0]  # (1, T): True on real keys
    with record_attention() as recorder:
        scaled_dot_product_attention(q, k, v, causal=True)
        scaled_dot_product_attention(q, k, v, mask=padding)
        scaled_dot_product_attention(q, k, v, mask=padding, causal=True)
    weights = [w[0].numpy() for w in recorder.weights_of()]  # causal, padding, both
    on_padding = max(float(w[:, length:].max()) if length < t else 0.0 for w in weights[1:])
    # A padding query in the combined case still sees its own earlier real keys: its row is not empty.
    row_sums = np.concatenate([w.sum(axis=-1) for w in weights])
    return MasksResult(
        tokens=list(tokens),
        length=length,
        causal_mask=causal.numpy(),
        padding_mask=np.broadcast_to(padding.numpy(), (t, t)).copy(),
        causal_weights=weights[0],
        padding_weights=weights[1],
        combined_weights=weights[2],
        max_above_diagonal=float(np.triu(weights[0], k=1).max()),
        max_on_padding=on_padding,
        max_row_sum_error=float(np.abs(row_sums - 1).max()),
    )


def plot(result: MasksResult, path: str | Path | None) -> Figure:
    """The masks (top) and the weights they give (bottom), tokens on both axes (PNG; path None: no file)."""
    fig, axes = new_figure(2, 3, width=14, height=8.6, margins=Margins(left=0.9, bottom=1.0, wspace=1.6, hspace=1.3))
    pad = [tok if i < result.length else "<pad>" for i, tok in enumerate(result.tokens)]
    both = result.causal_mask & result.padding_mask
    panels = [
        ("Causal mask (grey = may attend)", result.causal_mask, result.causal_weights, result.tokens),
        (f"Padding mask: {len(pad) - result.length} padding keys", result.padding_mask, result.padding_weights, pad),
        ("Causal + padding", both, result.combined_weights, pad),
    ]
    for col, (title, mask, weights, tokens) in enumerate(panels):
        heatmap(axes[0, col], mask.astype(float), title, "key token", "query token", tokens, tokens,
                cmap="Greys", vmin=0, vmax=1.6)  # fmt: skip
        weight_title = "weights: zero above the diagonal" if col == 0 else "weights: padding columns are zero"
        heatmap(axes[1, col], weights, f"{weight_title}; rows sum to 1", "key token", "query token", tokens,
                tokens, cbar_label="attention weight", vmin=0, vmax=1, annotate=True)  # fmt: skip
    return save(fig, path)


def run(out_dir: Path, length: int = 4, seed: int = 0) -> Section:
    """Run the experiment with these options, write masks.png, return the section for the report."""
    result = masks(length=length, seed=seed)
    path = out_dir / "masks.png"
    plot(result, path)
    return Section("masks", TITLE, EXPLANATION, [result.table()], [path])
