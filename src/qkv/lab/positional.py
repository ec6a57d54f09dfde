"""The sinusoidal positional encoding, looked at four ways, and its rotation property checked.

PE(p, 2i) = sin(p·ωᵢ), PE(p, 2i+1) = cos(p·ωᵢ) with ωᵢ = 10000^(−2i/d). By the angle-addition
formulas, sin((p+k)ω) = sin(pω)cos(kω) + cos(pω)sin(kω) and cos((p+k)ω) = cos(pω)cos(kω) − sin(pω)sin(kω):
each (sin, cos) pair turns by the angle kω, so PE(p+k) = M_k PE(p) with M_k block-diagonal, built from
k alone — the same matrix for every position p.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from qkv.errors import QkvError
from qkv.lab.plotting import COLORS, Margins, Section, format_table, heatmap, label, new_figure, save
from qkv.positional import sinusoidal_table

if TYPE_CHECKING:
    from matplotlib.figure import Figure

TITLE = "Sinusoidal positional encoding"
EXPLANATION = (
    "The paper adds PE(p) to the embedding of the token at position p: sines and cosines whose wavelengths "
    "grow geometrically from 2π to 10000·2π across the dimensions, so early dimensions change fast and late "
    "ones slowly (the heat map and the curves). The dot product PE(p)·PE(q) depends only on the distance p − q "
    "and falls off from the diagonal (the similarity matrix). And for every offset k there is one matrix "
    "M_k — a rotation of each (sin, cos) pair by the angle k·ωᵢ — with PE(p+k) = M_k PE(p) at every position "
    "p: the table reports how exactly that holds, which is why the authors hoped relative positions would be "
    "easy for attention to learn."
)


def frequencies(d_model: int) -> np.ndarray:
    """ωᵢ = 10000^(−2i/d) for the d/2 (sin, cos) pairs, exactly as qkv.positional builds them."""
    return np.exp(np.arange(0, d_model, 2) * (-math.log(10000.0) / d_model))


def rotation(k: int, d_model: int) -> np.ndarray:
    """M_k (d, d): the block-diagonal rotation with PE(p + k) = M_k PE(p), built from k and d alone."""
    m = np.zeros((d_model, d_model))
    for i, w in enumerate(frequencies(d_model)):
        c, s = math.cos(k * w), math.sin(k * w)
        # Rows act on (sin, cos) = dims (2i, 2i+1): [sin'; cos'] = [[c, s], [−s, c]] [sin; cos].
        m[2 * i : 2 * i + 2, 2 * i : 2 * i + 2] = [[c, s], [-s, c]]
    return m


@dataclass
class PositionalResult:
    """The table, its similarity matrix, and how well PE(p+k) = M_k PE(p) holds per offset k."""

    pe: np.ndarray  # (max_len, d_model) sinusoidal_table's float32 values, as float64
    similarity: np.ndarray  # (max_len, max_len) PE(p)·PE(q)
    offsets: np.ndarray  # (n,) int
    rotation_error: np.ndarray  # (n,) max |M_k PE(p) − PE(p+k)| over positions p and dimensions
    toeplitz_error: float  # max |PE(p)·PE(q) − Σᵢ cos((p−q)ωᵢ)|: the similarity depends on p − q only

    def table(self) -> str:
        """The rotation check per offset, and the shape of what was plotted."""
        length, d = self.pe.shape
        rows = [[str(int(k)), f"({d}, {d})", err] for k, err in zip(self.offsets, self.rotation_error, strict=True)]
        text = format_table(
            ["offset k", "M_k shape", "max |M_k·PE(p) − PE(p+k)|"],
            rows,
            title=f"PE(p+k) = M_k PE(p) for every position p < {length - int(self.offsets.max())}, "
            f"d_model = {d} (float32 table)",
        )
        return (
            f"{text}\n\nPE(p)·PE(q) = Σᵢ cos((p − q)·ωᵢ), a function of p − q only: "
            f"max deviation {self.toeplitz_error:.2e} over the {length}×{length} similarity matrix"
        )

    def __str__(self) -> str:
        """Same as table()."""
        return self.table()


def positional(max_len: int = 100, d_model: int = 64, offsets: Sequence[int] = (1, 2, 5, 10, 25)) -> PositionalResult:
    """The encodings of positions 0 … max_len − 1, their similarities, and the rotation check per offset."""
    if max_len < 2 or d_model < 2 or d_model % 2:
        raise QkvError(f"need max_len ≥ 2 and an even d_model ≥ 2, got max_len={max_len}, d_model={d_model}")
    if not offsets or any(int(k) < 1 or int(k) >= max_len for k in offsets):
        raise QkvError(f"offsets must be between 1 and max_len − 1 = {max_len - 1}, got {list(offsets)}")
    pe = sinusoidal_table(max_len, d_model).double().numpy()  # the library's own table
    errors = []
    for k in offsets:
        k = int(k)
        predicted = pe[: max_len - k] @ rotation(k, d_model).T  # row p: M_k PE(p)
        errors.append(np.abs(predicted - pe[k:]).max())
    similarity = pe @ pe.T
    distance = np.arange(max_len)[:, None] - np.arange(max_len)[None, :]
    expected = np.cos(distance[..., None] * frequencies(d_model)).sum(axis=-1)
    return PositionalResult(pe, similarity, np.array([int(k) for k in offsets]), np.array(errors),
                            float(np.abs(similarity - expected).max()))  # fmt: skip


def plot(result: PositionalResult, path: str | Path | None, curves: Sequence[int] = (2, 10, 11, 20, 30)) -> Figure:
    """Heat map, a few dimensions as curves, the similarity matrix and the rotation errors (PNG; path None: no file)."""
    fig, axes = new_figure(2, 2, width=12, height=8.4, margins=Margins(wspace=1.6))
    length, d = result.pe.shape
    heatmap(axes[0, 0], result.pe, f"PE table: {length} positions × {d} dimensions", "dimension",
            "position", cbar_label="PE value", cmap="RdBu_r", vmin=-1, vmax=1)  # fmt: skip
    ax = axes[0, 1]
    for dim in (i for i in curves if i < d):
        kind = "sin" if dim % 2 == 0 else "cos"  # a cos dim shares its colour with its sin partner
        period = 2 * math.pi / frequencies(d)[dim // 2]
        ax.plot(result.pe[:, dim], color=COLORS[(dim // 2) % len(COLORS)], ls="-" if kind == "sin" else "--",
                label=f"dim {dim} ({kind}, period {period:.0f} positions)")  # fmt: skip
    label(ax, "A few dimensions: low dims oscillate fast, high dims slowly", "position", "PE value")
    ax.set_ylim(-1.1, 1.6)  # headroom for the legend above the curves
    ax.legend(fontsize=7, loc="upper center", ncols=2)
    heatmap(axes[1, 0], result.similarity, "Similarity PE(p)·PE(q): depends on p − q only", "position q",
            "position p", cbar_label="dot product")  # fmt: skip
    ax = axes[1, 1]
    errors = np.maximum(result.rotation_error, 1e-12)  # an exact 0 would vanish from a log axis
    ax.bar([str(k) for k in result.offsets], errors, color=COLORS[0], label="measured (float32 table)")
    ax.axhline(1e-5, color=COLORS[1], ls="--", label="tolerance 1e-5")
    ax.set_yscale("log")
    ax.set_ylim(errors.min() / 10, 1e-4)
    label(ax, "PE(p+k) = M_k PE(p): max error over all p", "offset k (positions)", "max absolute error")
    ax.legend(fontsize=8)
    return save(fig, path)


def run(out_dir: Path, max_len: int = 100, d_model: int = 64, offsets: Sequence[int] = (1, 2, 5, 10, 25)) -> Section:
    """Run the experiment with these options, write positional.png, return the section for the report."""
    result = positional(max_len, d_model, offsets)
    path = out_dir / "positional.png"
    plot(result, path)
    return Section("positional", TITLE, EXPLANATION, [result.table()], [path])
