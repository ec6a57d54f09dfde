"""Shared helpers of the lab: figures, heat maps, text tables, and the Section every experiment returns.

Figures are plain `matplotlib.figure.Figure` objects drawn by the Agg backend, never pyplot ones:
pyplot keeps every figure alive in a global registry until closed, and these are returned to the
caller (tests read their titles and labels), so an unmanaged figure is freed like any object.
matplotlib is imported inside the functions, so importing the lab (as `qkv --help` does) stays cheap.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

# One palette for the lab, so "unscaled" and "scaled" (etc.) look the same in every figure.
COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b")


@dataclass
class Section:
    """What one experiment produced: a title, one explanatory paragraph, text tables and PNG files."""

    name: str
    title: str
    explanation: str
    tables: list[str] = field(default_factory=list)
    images: list[Path] = field(default_factory=list)


@dataclass(frozen=True)
class Margins:
    """Space around and between the axes, in inches (so it does not shrink or grow with the figure)."""

    left: float = 0.8
    right: float = 0.25
    bottom: float = 0.7
    top: float = 0.45
    wspace: float = 0.9
    hspace: float = 0.9


def new_figure(
    nrows: int = 1, ncols: int = 1, width: float = 6.0, height: float = 4.2, margins: Margins | None = None
) -> tuple[Figure, np.ndarray]:
    """A figure of nrows × ncols axes (returned as a 2-D array), drawn by Agg, with fixed margins.

    The layout is computed from `margins` rather than by matplotlib's constrained layout: that engine
    measures every text on every draw and costs more than the drawing itself (~0.6 s per figure).
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    m = margins or Margins()
    fig = Figure(figsize=(width, height), dpi=100)
    FigureCanvasAgg(fig)  # attaches the Agg canvas: PNG output without any GUI backend
    axes = fig.subplots(nrows, ncols, squeeze=False)
    # subplots_adjust wants fractions; wspace/hspace are fractions of the average axes width/height.
    axes_w = max((width - m.left - m.right - (ncols - 1) * m.wspace) / ncols, 0.1)
    axes_h = max((height - m.bottom - m.top - (nrows - 1) * m.hspace) / nrows, 0.1)
    fig.subplots_adjust(left=m.left / width, right=1 - m.right / width, bottom=m.bottom / height,
                        top=1 - m.top / height, wspace=m.wspace / axes_w, hspace=m.hspace / axes_h)  # fmt: skip
    return fig, axes


def label(ax: Axes, title: str, xlabel: str, ylabel: str, grid: bool = True) -> None:
    """Title and axis labels (every lab plot has all three), plus a light grid."""
    ax.set_title(title, fontsize=10)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if grid:
        ax.grid(alpha=0.3)


def save(fig: Figure, path: str | Path | None) -> Figure:
    """Write the figure as PNG (atomically: a reader never sees half a file) and return it.

    path None: only return the figure (to show it in a notebook, or to inspect it), no drawing cost.
    """
    if path is None:
        return fig
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    fig.savefig(tmp, format="png")
    tmp.replace(path)
    return fig


def heatmap(
    ax: Axes,
    matrix: np.ndarray,
    title: str,
    xlabel: str,
    ylabel: str,
    xticklabels: Sequence[str] | None = None,
    yticklabels: Sequence[str] | None = None,
    cbar_label: str | None = None,
    cmap: str = "viridis",
    vmin: float | None = None,
    vmax: float | None = None,
    annotate: bool = False,
) -> None:
    """A matrix as an image (row 0 at the top), optional tick labels, colour bar and cell values."""
    image = ax.imshow(matrix, cmap=cmap, vmin=vmin, vmax=vmax, aspect="auto", interpolation="nearest")
    label(ax, title, xlabel, ylabel, grid=False)
    if xticklabels is not None:
        ax.set_xticks(range(len(xticklabels)), labels=list(xticklabels), rotation=90, fontsize=7)
    if yticklabels is not None:
        ax.set_yticks(range(len(yticklabels)), labels=list(yticklabels), fontsize=7)
    if cbar_label is not None:
        ax.figure.colorbar(image, ax=ax, label=cbar_label, shrink=0.85)
    if annotate:
        lo, hi = image.get_clim()  # the colour scale's ends, so the text contrasts with its own cell
        middle = (lo + hi) / 2
        for (i, j), value in np.ndenumerate(matrix):
            # Light text on the dark end of viridis, dark text on the bright end.
            colour = "white" if value < middle else "black"
            ax.text(j, i, f"{value:.2f}", ha="center", va="center", fontsize=7, color=colour)


def head_grid(
    weights: np.ndarray,
    query_tokens: Sequence[str],
    key_tokens: Sequence[str],
    title: str,
    annotate: bool = False,
    vmax: float | None = 1.0,
) -> Figure:
    """Attention weights (H, T_q, T_k) as a grid of heat maps, one per head, tokens on both axes.

    vmax: top of the colour scale, shared by every head (None: the largest weight shown).
    """
    n_heads = weights.shape[0]
    ncols = min(n_heads, 4)
    nrows = -(-n_heads // ncols)
    side = 1.2 + 0.22 * max(len(key_tokens), 6)  # grows with the number of tokens so labels stay legible
    # Room for the longest tick label (7-point text, ~0.065 in per character) plus the axis label.
    ticks = 0.1 + 0.065 * max(len(t) for t in [*query_tokens, *key_tokens])
    m = Margins(left=ticks + 0.45, right=1.1, bottom=ticks + 0.45, top=0.8, wspace=ticks + 0.6, hspace=ticks + 0.8)
    width = ncols * side + m.left + m.right + (ncols - 1) * m.wspace
    height = nrows * side + m.bottom + m.top + (nrows - 1) * m.hspace
    fig, axes = new_figure(nrows, ncols, width=width, height=height, margins=m)
    for h, ax in enumerate(axes.flat):
        if h >= n_heads:
            ax.set_visible(False)
            continue
        heatmap(ax, weights[h], f"head {h}", "key token", "query token", key_tokens, query_tokens,
                vmin=0.0, vmax=float(weights.max()) if vmax is None else vmax, annotate=annotate)  # fmt: skip
    # The colour bar gets its own axes in the right margin, so the heads keep their square cells.
    cax = fig.add_axes((1 - 0.95 / width, m.bottom / height, 0.15 / width, 1 - (m.bottom + m.top) / height),
                       label="<colorbar>")  # matplotlib's own name for colour-bar axes  # fmt: skip
    fig.colorbar(axes.flat[0].images[0], cax=cax, label="attention weight")
    fig.suptitle(title)
    return fig


def display_token(token: str) -> str:
    """A token as an axis label: spaces and line breaks made visible, long tokens shortened."""
    shown = token.replace(" ", "␣").replace("\n", "\\n").replace("\t", "\\t")
    return shown if len(shown) <= 12 else shown[:11] + "…"


def fmt_num(value: float, digits: int = 4) -> str:
    """A number for a table: fixed point when moderate, scientific when tiny or huge."""
    value = float(value)
    if value != 0 and (abs(value) >= 1e6 or abs(value) < 10 ** (1 - digits)):
        return f"{value:.{max(digits - 1, 1)}e}"
    return f"{value:.{digits}f}"


def fmt_vector(vector: np.ndarray, digits: int = 2, style: str = "f") -> str:
    """[ 1.00, -0.50] — a short vector on one line; style "g" keeps tiny values visible (4.5e-05)."""
    width = digits + (6 if style == "g" else 4)
    return "[" + ", ".join(f"{float(v):{width}.{digits}{style}}" for v in vector) + "]"


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]], title: str | None = None) -> str:
    """A plain-text table: a header, a rule, right-aligned cells (floats via fmt_num); optional title."""
    cells = [[c if isinstance(c, str) else fmt_num(c) for c in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)]
    # Text columns read best left-aligned, numbers right-aligned (the first row decides, like a spreadsheet).
    left = [i == 0 or (bool(rows) and isinstance(rows[0][i], str) and not _numeric(rows[0][i]))
            for i in range(len(headers))]  # fmt: skip

    def line(values: Sequence[str]) -> str:
        """One row, each cell padded to its column's width."""
        return "  ".join(
            v.ljust(w) if lft else v.rjust(w) for v, w, lft in zip(values, widths, left, strict=True)
        ).rstrip()

    lines = [title] if title else []
    lines += [line(headers), "  ".join("-" * w for w in widths)]
    lines += [line(row) for row in cells]
    return "\n".join(lines)


def _numeric(text: str) -> bool:
    """Whether a pre-formatted cell holds a number ("+3.2 %" and "1.0e-05" count; "[0.1, 0.2]" does not)."""
    try:
        float(text.replace("%", "").replace(",", "").strip())
    except ValueError:
        return False
    return True
