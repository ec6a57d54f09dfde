"""BatchNorm vs LayerNorm vs RMSNorm (qkv.norms) on the same activations.

BatchNorm normalises each *feature* over the batch and time; LayerNorm and RMSNorm normalise each
*token* over its features. So a token's BatchNorm output depends on the other sequences in its
batch — noisier the smaller the batch, and different at inference (running statistics) than in
training — while LayerNorm and RMSNorm give a token the same output whatever its batch mates.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F

from qkv.errors import QkvError
from qkv.lab.plotting import COLORS, Margins, Section, format_table, label, new_figure, save
from qkv.norms import BatchNorm, LayerNorm, RMSNorm

if TYPE_CHECKING:
    from matplotlib.figure import Figure

TITLE = "BatchNorm vs LayerNorm vs RMSNorm"
EXPLANATION = (
    "Activations whose features have very different means and scales go through the three norms. BatchNorm "
    "makes every feature mean 0, std 1 over the batch; LayerNorm makes every token mean 0, std 1 over its "
    "features; RMSNorm only makes every token's root-mean-square 1. Then one fixed sequence is normalised "
    "inside batches of 64, 8, 2 and 1 sequences with random batch mates: its BatchNorm output moves with the "
    "batch mates and drifts from what the population statistics would give as the batch shrinks, while its "
    "LayerNorm and RMSNorm outputs never change. That, plus variable-length padded sequences, is why "
    "Transformers use LayerNorm or RMSNorm. The timing is a small indicative measurement on this machine, not "
    "a benchmark: RMSNorm saves the mean and the bias, but in eager PyTorch on a CPU, LayerNorm is one fused "
    "kernel while RMSNorm runs as several small operations, so it need not come out faster here; the saving "
    "shows in fused (GPU or compiled) kernels."
)
NAMES = ("BatchNorm", "LayerNorm", "RMSNorm")


@dataclass
class NormsResult:
    """Statistics after each norm, BatchNorm's dependence on the batch, and an indicative timing."""

    rows: list[str]  # "input" then NAMES
    feature_mean: np.ndarray  # (4,) mean over features of |mean of the feature over all tokens|
    feature_std: np.ndarray  # (4,) mean over features of the feature's std over all tokens
    token_mean: np.ndarray  # (4,) mean over tokens of |mean of the token over its features|
    token_std: np.ndarray  # (4,) mean over tokens of the token's std over its features
    token_rms: np.ndarray  # (4,) mean over tokens of the token's root-mean-square
    batch_sizes: np.ndarray  # (n,)
    stat_gap: np.ndarray  # (n,) mean |batch mean − population mean| / population std, over features
    output_gap: np.ndarray  # (3, n) mean max |y(fixed seq in batch) − y(reference)|; reference: population stats
    batchmate_spread: np.ndarray  # (3, n) max change of the fixed sequence's output across batch mates
    timing_ms: np.ndarray  # (3,) median ms per call: qkv LayerNorm, qkv RMSNorm, torch's rms_norm
    timing_labels: list[str]
    timing_shape: tuple[int, int, int]
    timing_reps: int

    def table(self) -> str:
        """Three tables: statistics after normalising, batch-size dependence, timing."""
        stats = format_table(
            ["", "feature |mean|", "feature std", "token |mean|", "token std", "token rms"],
            [
                [r, *v]
                for r, *v in zip(
                    self.rows,
                    self.feature_mean,
                    self.feature_std,
                    self.token_mean,
                    self.token_std,
                    self.token_rms,
                    strict=True,
                )
            ],
            title="mean and std per feature (over all tokens of a batch of 64) and per token (over its features)",
        )
        batch_rows = [
            [str(int(b)), g, *self.output_gap[:, i], *self.batchmate_spread[:, i]]
            for i, (b, g) in enumerate(zip(self.batch_sizes, self.stat_gap, strict=True))
        ]
        short = ("BN", "LN", "RMS")
        batch = format_table(
            ["batch", "BN mean gap", *(f"{n} drift" for n in short), *(f"{n} spread" for n in short)],
            batch_rows,
            title="one fixed sequence in batches of random mates\n"
            "  BN mean gap: |batch mean − population mean| / population std, averaged over features\n"
            "  drift: max |output − batch-independent output| (BN: with population statistics; LN, RMS: alone)\n"
            "  spread: max change of the sequence's output from one set of batch mates to another",
        )
        b, t, d = self.timing_shape
        timing = format_table(
            ["", "ms per call (median)"],
            [[n, ms] for n, ms in zip(self.timing_labels, self.timing_ms, strict=True)],
            title=f"INDICATIVE timing only (CPU, input {b}×{t}×{d}, {self.timing_reps} calls each; not a benchmark)",
        )
        return f"{stats}\n\n{batch}\n\n{timing}"

    def __str__(self) -> str:
        """Same as table()."""
        return self.table()


def _statistics(y: torch.Tensor) -> list[float]:
    """feature |mean|, feature std, token |mean|, token std, token rms of y (B, T, d)."""
    tokens = y.reshape(-1, y.shape[-1])  # (B·T, d)
    return [
        tokens.mean(0).abs().mean().item(),
        tokens.std(0, unbiased=False).mean().item(),
        tokens.mean(1).abs().mean().item(),
        tokens.std(1, unbiased=False).mean().item(),
        tokens.pow(2).mean(1).sqrt().mean().item(),
    ]


def _indicative_timing(shape: tuple[int, int, int], reps: int) -> np.ndarray:
    """Median milliseconds per call of LayerNorm, RMSNorm and torch's rms_norm (tiny, indicative)."""
    x = torch.randn(*shape)
    layer, rms = LayerNorm(shape[-1]), RMSNorm(shape[-1])
    calls = (layer, rms, lambda t: F.rms_norm(t, (shape[-1],), rms.weight, rms.eps))
    medians = []
    with torch.no_grad():
        for fn in calls:
            fn(x)  # warm-up: the first call pays for allocation
            times = []
            for _ in range(reps):
                start = time.perf_counter()
                fn(x)
                times.append(time.perf_counter() - start)
            medians.append(1000 * float(np.median(times)))
    return np.array(medians)


def norms(
    batch_sizes: Sequence[int] = (64, 8, 2, 1),
    seq_len: int = 16,
    d_model: int = 32,
    repeats: int = 20,
    timing_reps: int = 20,
    seed: int = 0,
) -> NormsResult:
    """Normalise the same activations three ways; measure BatchNorm's dependence on its batch mates."""
    # seq_len ≥ 2: a batch of one sequence of one token would give BatchNorm a single value per feature.
    if not batch_sizes or any(int(b) < 1 for b in batch_sizes) or seq_len < 2 or d_model < 2 or repeats < 2:
        raise QkvError(f"need batch sizes ≥ 1, seq_len ≥ 2, d_model ≥ 2, repeats ≥ 2 (got {list(batch_sizes)}, "
                       f"{seq_len}, {d_model}, {repeats})")  # fmt: skip
    gen = torch.Generator().manual_seed(seed)
    # Features with their own offset and scale, as real activations have: what BatchNorm undoes per feature.
    pop_mean = torch.rand(d_model, generator=gen) * 6 - 3  # U(−3, 3)
    pop_std = torch.rand(d_model, generator=gen) * 2.5 + 0.5  # U(0.5, 3)

    def sample(n: int) -> torch.Tensor:
        """n sequences drawn from the population."""
        return pop_mean + pop_std * torch.randn(n, seq_len, d_model, generator=gen)

    modules = {"BatchNorm": BatchNorm(d_model), "LayerNorm": LayerNorm(d_model), "RMSNorm": RMSNorm(d_model)}
    reference_bn = BatchNorm(d_model).eval()  # eval mode: normalises with the population statistics
    running_mean, running_var = reference_bn.norm.running_mean, reference_bn.norm.running_var
    assert running_mean is not None and running_var is not None  # track_running_stats is on by default
    running_mean.copy_(pop_mean)
    running_var.copy_(pop_std**2)
    x = sample(64)
    with torch.no_grad():
        stats = [_statistics(x)] + [_statistics(m.train()(x)) for m in modules.values()]
        fixed = sample(1)  # the sequence we follow from batch to batch
        references = [reference_bn(fixed), modules["LayerNorm"](fixed), modules["RMSNorm"](fixed)]
        n = len(batch_sizes)
        stat_gap, output_gap, spread = np.zeros(n), np.zeros((3, n)), np.zeros((3, n))
        for i, b in enumerate(int(b) for b in batch_sizes):
            outputs: list[list[torch.Tensor]] = [[], [], []]
            for _ in range(repeats):
                batch = torch.cat([fixed, sample(b - 1)])  # fixed sequence first, then its batch mates
                tokens = batch.reshape(-1, d_model)
                stat_gap[i] += ((tokens.mean(0) - pop_mean).abs() / pop_std).mean().item() / repeats
                for j, module in enumerate(modules.values()):
                    outputs[j].append(module(batch)[0])  # train mode: BatchNorm uses this batch's statistics
            for j in range(3):
                ys = torch.stack(outputs[j])  # (repeats, T, d)
                output_gap[j, i] = (ys - references[j][0]).abs().amax(dim=(1, 2)).mean().item()
                spread[j, i] = (ys - ys[0]).abs().max().item()
    shape = (16, 64, 256)
    labels = ["qkv LayerNorm (F.layer_norm)", "qkv RMSNorm (composite ops)", "torch F.rms_norm"]
    timing = _indicative_timing(shape, timing_reps) if timing_reps > 0 else np.full(3, np.nan)
    s = np.array(stats)
    return NormsResult(["input", *NAMES], s[:, 0], s[:, 1], s[:, 2], s[:, 3], s[:, 4],
                       np.array([int(b) for b in batch_sizes]), stat_gap, output_gap, spread, timing, labels,
                       shape, timing_reps)  # fmt: skip


def plot(result: NormsResult, path: str | Path | None) -> Figure:
    """Statistics per norm, output drift against batch size, and the indicative timing (PNG; path None: no file)."""
    fig, axes = new_figure(1, 3, width=16, height=4.6, margins=Margins(bottom=0.85))
    ax = axes[0, 0]
    series = [("feature |mean|", result.feature_mean), ("feature std", result.feature_std),
              ("token |mean|", result.token_mean), ("token std", result.token_std)]  # fmt: skip
    for j, (name, values) in enumerate(series):
        ax.bar(np.arange(len(result.rows)) + (j - 1.5) * 0.2, values, 0.2, color=COLORS[j], label=name)
    ax.set_xticks(range(len(result.rows)), labels=result.rows)
    label(ax, "After normalising: which statistics become 0 and 1", "normalisation", "value (activation units)")
    ax.legend(fontsize=8)

    ax = axes[0, 1]
    x = np.arange(len(result.batch_sizes))  # even spacing, batch sizes as labels (64 … 1)
    for j, name in enumerate(NAMES):
        ax.plot(x, result.output_gap[j], "o-", color=COLORS[j], label=f"{name}: drift from batch-free output")
        ax.plot(
            x, result.batchmate_spread[j], "s--", color=COLORS[j], alpha=0.6, label=f"{name}: spread over batch mates"
        )
    ax.set_xticks(x, labels=[str(b) for b in result.batch_sizes])
    label(ax, "One fixed sequence: only BatchNorm's output depends on its batch", "batch size (sequences)",
          "max |output difference|")  # fmt: skip
    ax.legend(fontsize=7)

    ax = axes[0, 2]
    ax.bar(range(3), result.timing_ms, color=COLORS[:3])
    ax.set_xticks(range(3), labels=[n.replace(" (", "\n(") for n in result.timing_labels], fontsize=8)
    b, t, d = result.timing_shape
    label(ax, f"INDICATIVE timing, {b}×{t}×{d} input (not a benchmark)", "normalisation", "ms per call (median)")
    return save(fig, path)


def run(out_dir: Path, batch_sizes: Sequence[int] = (64, 8, 2, 1), timing_reps: int = 20, seed: int = 0) -> Section:
    """Run the experiment with these options, write norms.png, return the section for the report."""
    result = norms(batch_sizes, timing_reps=timing_reps, seed=seed)
    path = out_dir / "norms.png"
    plot(result, path)
    return Section("norms", TITLE, EXPLANATION, [result.table()], [path])
