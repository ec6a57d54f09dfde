"""Softmax saturation: large scores make the output one-hot and its Jacobian vanish.

y = softmax(x) has the Jacobian ∂y/∂x = diag(y) − y yᵀ. When one score dominates, y is nearly
one-hot, so diag(y) ≈ y yᵀ and the Jacobian is ≈ 0: almost no gradient flows back into the scores.
Unscaled dot products of d_k-dimensional vectors have a standard deviation of √d_k, which is
exactly how a softmax gets pushed there; the 1/√d_k scale keeps it out.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from qkv.errors import QkvError
from qkv.lab.plotting import COLORS, Section, fmt_vector, format_table, label, new_figure, save

if TYPE_CHECKING:
    from matplotlib.figure import Figure

TITLE = "Softmax saturation: one-hot outputs, vanishing gradients"
EXPLANATION = (
    "Multiply a fixed score vector by a growing factor a and the softmax output turns one-hot: the largest "
    "probability goes to 1, the entropy to 0, and the Jacobian diag(y) − yyᵀ, which is what carries the "
    "gradient from the attention weights back to the scores, goes to zero. Unscaled dot products of "
    "d_k-dimensional vectors have a standard deviation of √d_k, so without the 1/√d_k scale a wider head "
    "means a more saturated softmax and a weaker gradient; with it, both stay put as d_k grows."
)


def stable_softmax(x: np.ndarray) -> np.ndarray:
    """softmax over the last axis; subtracting the max first keeps exp() from overflowing."""
    z = np.exp(x - x.max(axis=-1, keepdims=True))
    return z / z.sum(axis=-1, keepdims=True)


def softmax_jacobian(y: np.ndarray) -> np.ndarray:
    """∂softmax/∂x = diag(y) − y yᵀ for probability vectors y (..., n) → (..., n, n)."""
    return y[..., :, None] * np.eye(y.shape[-1]) - y[..., :, None] * y[..., None, :]


def entropy(y: np.ndarray) -> np.ndarray:
    """Shannon entropy in nats over the last axis (0·log 0 taken as 0)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        terms = np.where(y > 0, y * np.log(y), 0.0)
    return -terms.sum(axis=-1)


@dataclass
class SoftmaxResult:
    """softmax(a·x) for each scale a, and softmax saturation on random q·K rows against d_k."""

    base: np.ndarray  # (n,) the score vector x
    scales: np.ndarray  # (m,) the factors a
    probs: np.ndarray  # (m, n) softmax(a·x)
    max_prob: np.ndarray  # (m,)
    entropy: np.ndarray  # (m,) nats
    jacobian_norm: np.ndarray  # (m,) Frobenius norm of diag(y) − y yᵀ
    d_ks: np.ndarray  # (k,)
    n_keys: int
    trials: int
    max_prob_unscaled: np.ndarray  # (k,) mean largest probability of softmax(q·K)
    max_prob_scaled: np.ndarray  # (k,) the same for softmax(q·K / √d_k)
    grad_norm_unscaled: np.ndarray  # (k,) mean Frobenius norm of the Jacobian
    grad_norm_scaled: np.ndarray  # (k,)

    def table(self) -> str:
        """Both halves of the experiment as text tables."""
        rows = [
            [f"{a:g}", fmt_vector(p, 4, "g"), m, h, j]
            for a, p, m, h, j in zip(
                self.scales, self.probs, self.max_prob, self.entropy, self.jacobian_norm, strict=True
            )
        ]
        first = format_table(
            ["a", "softmax(a·x)", "max prob", "entropy (nats)", "‖J‖_F"],
            rows,
            title=f"softmax(a·x) for x = {fmt_vector(self.base, 1)}; J = diag(y) − y yᵀ",
        )
        rows = [
            [str(int(d)), mu, ms, gu, gs]
            for d, mu, ms, gu, gs in zip(
                self.d_ks,
                self.max_prob_unscaled,
                self.max_prob_scaled,
                self.grad_norm_unscaled,
                self.grad_norm_scaled,
                strict=True,
            )
        ]
        second = format_table(
            ["d_k", "max prob q·K", "max prob q·K/√d_k", "‖J‖_F q·K", "‖J‖_F q·K/√d_k"],
            rows,
            title=f"random score rows q·K, q and {self.n_keys} keys ~ N(0, I_d_k), mean over {self.trials} rows "
            f"(uniform would give max prob {1 / self.n_keys:.4f})",
        )
        return f"{first}\n\n{second}"

    def __str__(self) -> str:
        """Same as table()."""
        return self.table()


def softmax(
    base: Sequence[float] = (1.0, 1.0, 2.0),
    scales: Sequence[float] = (1.0, 10.0, 100.0),
    d_ks: Sequence[int] = (4, 16, 64, 256, 1024),
    n_keys: int = 16,
    trials: int = 300,
    seed: int = 0,
) -> SoftmaxResult:
    """Saturation of softmax(a·x) over the scales a, and of random q·K rows with and without 1/√d_k."""
    if len(base) < 2:
        raise QkvError(f"the base score vector needs at least 2 entries, got {list(base)}")
    if not scales:
        raise QkvError("give at least one scale a")
    if not d_ks or any(int(d) < 1 for d in d_ks) or n_keys < 2 or trials < 1:
        raise QkvError(f"need positive d_k values, at least 2 keys and 1 trial (got {list(d_ks)}, {n_keys}, {trials})")
    x = np.asarray(base, dtype=np.float64)
    a = np.asarray(scales, dtype=np.float64)
    probs = stable_softmax(a[:, None] * x[None, :])
    jac = softmax_jacobian(probs)

    rng = np.random.default_rng(seed)
    dims = np.array([int(d) for d in d_ks])
    stats = np.empty((4, len(dims)))
    for i, d in enumerate(dims):
        q = rng.standard_normal((trials, 1, d))
        keys = rng.standard_normal((trials, n_keys, d))
        raw = np.einsum("tod,tnd->tn", q, keys)  # (trials, n_keys): one score row per trial
        for j, scores in enumerate((raw, raw / np.sqrt(d))):
            y = stable_softmax(scores)
            stats[j, i] = y.max(axis=-1).mean()
            stats[2 + j, i] = np.linalg.norm(softmax_jacobian(y), axis=(-2, -1)).mean()
    return SoftmaxResult(
        base=x,
        scales=a,
        probs=probs,
        max_prob=probs.max(axis=-1),
        entropy=entropy(probs),
        jacobian_norm=np.linalg.norm(jac, axis=(-2, -1)),
        d_ks=dims,
        n_keys=n_keys,
        trials=trials,
        max_prob_unscaled=stats[0],
        max_prob_scaled=stats[1],
        grad_norm_unscaled=stats[2],
        grad_norm_scaled=stats[3],
    )


def plot(result: SoftmaxResult, path: str | Path | None) -> Figure:
    """Probabilities per scale, saturation against a, and saturation against d_k (PNG; path None: no file)."""
    fig, axes = new_figure(1, 3, width=15, height=4.4)
    ax = axes[0, 0]
    n, m = len(result.base), len(result.scales)
    width = 0.8 / m
    for i, (a, p) in enumerate(zip(result.scales, result.probs, strict=True)):
        ax.bar(np.arange(n) + (i - (m - 1) / 2) * width, p, width, color=COLORS[i % len(COLORS)], label=f"a = {a:g}")
    ax.set_xticks(range(n), labels=[f"x{i} = {v:g}" for i, v in enumerate(result.base)])
    ax.set_ylim(0, 1.05)
    label(ax, "softmax(a·x) turns one-hot as a grows", "score entry", "probability")
    ax.legend(fontsize=8)

    ax = axes[0, 1]
    positive = bool((result.scales > 0).all())  # a log axis only when every scale can sit on one
    lo, hi = result.scales.min(), result.scales.max()
    grid = np.geomspace(lo / 10, hi, 200) if positive else np.linspace(min(lo, 0), max(hi, 1), 200)
    probs = stable_softmax(grid[:, None] * result.base[None, :])  # smooth curves between the table's points
    ax.plot(grid, probs.max(axis=-1), color=COLORS[0], label="largest probability")
    ax.plot(grid, entropy(probs), color=COLORS[2], label="entropy (nats)")
    ax.plot(grid, np.linalg.norm(softmax_jacobian(probs), axis=(-2, -1)), color=COLORS[1], label="‖Jacobian‖_F")
    ax.plot(result.scales, result.jacobian_norm, "o", color=COLORS[1])
    if positive:
        ax.set_xscale("log")
    label(ax, "Saturation: the Jacobian vanishes as a grows", "scale a (multiplies the scores)",
          "probability, nats, or norm")  # fmt: skip
    ax.legend(fontsize=8)

    ax = axes[0, 2]
    ax.plot(result.d_ks, result.max_prob_unscaled, "o-", color=COLORS[0], label="max prob, q·K")
    ax.plot(result.d_ks, result.max_prob_scaled, "o--", color=COLORS[0], alpha=0.6, label=r"max prob, q·K/$\sqrt{d_k}$")
    ax.plot(result.d_ks, result.grad_norm_unscaled, "s-", color=COLORS[1], label="‖J‖_F, q·K")
    ax.plot(result.d_ks, result.grad_norm_scaled, "s--", color=COLORS[1], alpha=0.6, label=r"‖J‖_F, q·K/$\sqrt{d_k}$")
    ax.set_xscale("log")
    label(ax, f"Random score rows ({result.n_keys} keys): scaling keeps the gradient", "d_k (dimensions)",
          "mean over rows")  # fmt: skip
    ax.legend(fontsize=8)
    return save(fig, path)


def run(
    out_dir: Path,
    base: Sequence[float] = (1.0, 1.0, 2.0),
    scales: Sequence[float] = (1.0, 10.0, 100.0),
    d_ks: Sequence[int] = (4, 16, 64, 256, 1024),
    n_keys: int = 16,
    trials: int = 300,
    seed: int = 0,
) -> Section:
    """Run the experiment with these options, write softmax.png, return the section for the report."""
    result = softmax(base, scales, d_ks, n_keys, trials, seed)
    path = out_dir / "softmax.png"
    plot(result, path)
    return Section("softmax", TITLE, EXPLANATION, [result.table()], [path])
