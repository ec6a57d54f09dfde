"""Why attention divides by √d_k: the variance of q·k grows like d_k, the scaled score's stays at 1.

If q and k have d_k independent components of mean 0 and variance 1, each product qᵢkᵢ has mean 0
and variance 1, so q·k = Σᵢ qᵢkᵢ has variance d_k (variances of independent terms add). Dividing by
√d_k divides the variance by d_k. The dice analogy: one die has variance 35/12 ≈ 2.92; the sum of
n dice has variance n · 35/12 — the spread of a sum grows like √n, and dividing by √n undoes it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from qkv.errors import QkvError
from qkv.lab.plotting import COLORS, Section, format_table, label, new_figure, save

if TYPE_CHECKING:
    from matplotlib.figure import Figure

TITLE = "Why scale by √d_k: the variance of q·k"
EXPLANATION = (
    "Draw query and key vectors whose d_k components are independent N(0, 1). Their dot product q·k is a sum "
    "of d_k independent products of variance 1, so its variance is d_k: at d_k = 512 the scores spread over "
    "±45, and a softmax over such scores is nearly one-hot (see the softmax experiment). Dividing by √d_k "
    "brings the variance back to 1 whatever the head size, which is the 1/√d_k in "
    "softmax(QKᵀ/√d_k)V. The dice make the same point: the sum of n dice spreads like √n."
)
DIE_VARIANCE = 35 / 12  # variance of one fair six-sided die: E[X²] − E[X]² = 91/6 − 49/4


@dataclass
class VarianceResult:
    """Measured variance of q·k (unscaled and scaled by 1/√d_k) for each d_k, and the dice analogy."""

    d_ks: np.ndarray  # (n,) int
    trials: int
    var_unscaled: np.ndarray  # (n,) sample variance of q·k; theory: d_k
    var_scaled: np.ndarray  # (n,) sample variance of q·k / √d_k; theory: 1
    scores: np.ndarray  # (n, trials) the unscaled q·k samples, kept for the plot
    dice_var_sum: np.ndarray  # (n,) variance of the sum of d_k dice; theory: d_k · 35/12
    dice_var_scaled: np.ndarray  # (n,) variance of that sum / √d_k; theory: 35/12

    def table(self) -> str:
        """The measurements next to their theoretical values."""
        rows = [
            [str(int(d)), float(d), vu, f"{100 * (vu / d - 1):+.1f} %", vs, f"{100 * (vs - 1):+.1f} %"]
            for d, vu, vs in zip(self.d_ks, self.var_unscaled, self.var_scaled, strict=True)
        ]
        main = format_table(
            ["d_k", "theory", "var(q·k)", "rel. error", "var(q·k/√d_k)", "rel. error"],
            rows,
            title=f"variance of q·k over {self.trials:,} draws of q, k ~ N(0, I)  (theory: d_k unscaled, 1 scaled)",
        )
        dice_rows = [
            [str(int(n)), n * DIE_VARIANCE, s, DIE_VARIANCE, t]
            for n, s, t in zip(self.d_ks, self.dice_var_sum, self.dice_var_scaled, strict=True)
        ]
        dice = format_table(
            ["dice n", "theory", "var(sum)", "theory", "var(sum/√n)"],
            dice_rows,
            title="the dice analogy: one die has variance 35/12 = 2.9167; n dice summed have n times that",
        )
        return f"{main}\n\n{dice}"

    def __str__(self) -> str:
        """Same as table()."""
        return self.table()


def variance(d_ks: Sequence[int] = (5, 100, 512), trials: int = 1000, seed: int = 0) -> VarianceResult:
    """Measure var(q·k) and var(q·k/√d_k) over `trials` draws of q, k ~ N(0, I_{d_k})."""
    if not d_ks or any(int(d) < 1 for d in d_ks):
        raise QkvError(f"every d_k must be a positive integer, got {list(d_ks)}")
    if trials < 2:
        raise QkvError(f"need at least 2 trials to estimate a variance, got {trials}")
    rng = np.random.default_rng(seed)
    dims = np.array([int(d) for d in d_ks])
    scores = np.empty((len(dims), trials))
    dice_sum = np.empty((len(dims), trials))
    for i, d in enumerate(dims):
        q = rng.standard_normal((trials, d))
        k = rng.standard_normal((trials, d))
        scores[i] = np.einsum("td,td->t", q, k)  # one dot product per trial
        dice_sum[i] = rng.integers(1, 7, size=(trials, d)).sum(axis=1)
    roots = np.sqrt(dims)[:, None]
    return VarianceResult(
        d_ks=dims,
        trials=trials,
        var_unscaled=scores.var(axis=1, ddof=1),  # ddof=1: the unbiased estimator
        var_scaled=(scores / roots).var(axis=1, ddof=1),
        scores=scores,
        dice_var_sum=dice_sum.var(axis=1, ddof=1),
        dice_var_scaled=(dice_sum / roots).var(axis=1, ddof=1),
    )


def plot(result: VarianceResult, path: str | Path | None) -> Figure:
    """Variance against d_k (log-log, with theory), score histograms, and the dice (PNG; path None: no file)."""
    fig, axes = new_figure(1, 3, width=15, height=4.4)
    ax = axes[0, 0]
    dims = result.d_ks
    grid = np.geomspace(dims.min(), dims.max(), 50) if len(dims) > 1 else dims.astype(float)
    ax.plot(grid, grid, "--", color=COLORS[0], alpha=0.6, label="theory: d_k")
    ax.plot(grid, np.ones_like(grid), "--", color=COLORS[1], alpha=0.6, label="theory: 1")
    ax.plot(dims, result.var_unscaled, "o", color=COLORS[0], ms=8, label="measured, q·k")
    ax.plot(dims, result.var_scaled, "s", color=COLORS[1], ms=8, label=r"measured, q·k / $\sqrt{d_k}$")
    ax.set_xscale("log")
    ax.set_yscale("log")
    label(ax, f"Variance of q·k against d_k ({result.trials:,} draws each)", "d_k (dimensions)", "variance of q·k")
    ax.legend(fontsize=8)

    ax = axes[0, 1]
    # One violin per d_k for the raw scores and one for the scaled ones: the spread is the point.
    spots = np.arange(len(dims))
    scaled = result.scores / np.sqrt(dims)[:, None]
    for offset, data, colour in ((-0.2, result.scores, COLORS[0]), (0.2, scaled, COLORS[1])):
        parts = ax.violinplot(list(data), positions=spots + offset, widths=0.35, showextrema=False)
        for body in parts["bodies"]:
            body.set_facecolor(colour)
            body.set_alpha(0.7)
    ax.plot([], [], "s", color=COLORS[0], label="q·k")
    ax.plot([], [], "s", color=COLORS[1], label=r"q·k / $\sqrt{d_k}$")
    ax.set_xticks(spots, labels=[str(int(d)) for d in dims])
    label(ax, "Spread of the scores: grows like √d_k unless scaled", "d_k (dimensions)", "score value")
    ax.legend(fontsize=8)

    ax = axes[0, 2]
    ax.plot(dims, dims * DIE_VARIANCE, "--", color=COLORS[2], alpha=0.6, label="theory: n · 35/12")
    ax.plot(dims, result.dice_var_sum, "o", color=COLORS[2], ms=8, label="sum of n dice")
    ax.plot(dims, result.dice_var_scaled, "s", color=COLORS[3], ms=8, label=r"sum / $\sqrt{n}$")
    ax.axhline(DIE_VARIANCE, color=COLORS[3], ls="--", alpha=0.6, label="theory: 35/12 (one die)")
    ax.set_xscale("log")
    ax.set_yscale("log")
    label(ax, "The dice analogy: one die vs the sum of n", "n (dice summed)", "variance (pips²)")
    ax.legend(fontsize=8)
    return save(fig, path)


def run(out_dir: Path, d_ks: Sequence[int] = (5, 100, 512), trials: int = 1000, seed: int = 0) -> Section:
    """Run the experiment with these options, write variance.png, return the section for the report."""
    result = variance(d_ks, trials, seed)
    path = out_dir / "variance.png"
    plot(result, path)
    return Section("variance", TITLE, EXPLANATION, [result.table()], [path])
