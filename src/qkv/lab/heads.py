"""Multi-head attention, shape by shape, recomputed by hand from a real qkv.MultiHeadAttention.

X (T, d_model) → Q, K, V (T, d_model) → split into h heads (h, T, d_k) → scores (h, T, T) →
weights (h, T, T) → context (h, T, d_k) → concatenated (T, d_model) → W_O → output (T, d_model).
The step-by-step result must equal module(x): the walkthrough is checked, not just drawn.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from qkv.attention import MultiHeadAttention, record_attention
from qkv.errors import QkvError
from qkv.lab.plotting import Section, format_table, head_grid, save

if TYPE_CHECKING:
    from matplotlib.figure import Figure

TITLE = "Multi-head attention, shape by shape"
EXPLANATION = (
    "Multi-head attention runs h attentions side by side in smaller subspaces. One Linear per Q, K and V "
    "projects X (T, d_model) to (T, d_model); a reshape splits that into h heads of d_k = d_model/h "
    "dimensions, (h, T, d_k). Each head computes its own (T, T) scores and weights and a (T, d_k) context; "
    "the heads are concatenated back to (T, d_model) and mixed by W_O. The table follows the tensors of a "
    "real qkv.MultiHeadAttention (by default T = 6, d_model = 512, h = 8) step by step, and the final result "
    "is checked against calling the module. The image shows the 8 heads' weights (colour scale stretched to "
    "the largest weight): untrained, every head is close to uniform (1/T each) with its own small deviations; "
    "training is what makes heads specialise (see the attention maps of a trained run)."
)
WORDS = ("the", "cat", "sat", "on", "the", "mat")


@dataclass
class HeadsResult:
    """The steps (name, formula, shape), the per-head weights, and the agreement with the module."""

    steps: list[tuple[str, str, tuple[int, ...]]]
    tokens: list[str]
    weights: np.ndarray  # (h, T, T) per-head attention weights, computed step by step
    output: np.ndarray  # (T, d_model)
    max_abs_diff: float  # max |step-by-step output − module(x)|
    weights_diff: float  # max |step-by-step weights − the module's returned weights|
    n_params: int

    def table(self) -> str:
        """The shape walkthrough and the check against the module."""
        rows = [[name, formula, str(shape)] for name, formula, shape in self.steps]
        h, t, _ = self.weights.shape
        d_model = self.output.shape[1]
        text = format_table(
            ["step", "computed as", "shape"],
            rows,
            title=f"MultiHeadAttention(d_model={d_model}, n_heads={h}): T = {t}, d_k = {d_model // h}, "
            f"{self.n_params:,} parameters",
        )
        return (
            f"{text}\n\nstep by step vs module(x): max |difference| = {self.max_abs_diff:.2e} (output), "
            f"{self.weights_diff:.2e} (weights)"
        )

    def __str__(self) -> str:
        """Same as table()."""
        return self.table()


def heads(
    seq_len: int = 6, d_model: int = 512, n_heads: int = 8, seed: int = 0, tolerance: float = 1e-5
) -> HeadsResult:
    """Recompute a seeded MultiHeadAttention step by step on X (seq_len, d_model); check it equals module(x)."""
    if seq_len < 1 or n_heads < 1 or d_model % n_heads:
        raise QkvError(
            f"n_heads={n_heads} must divide d_model={d_model}, and the sequence needs ≥ 1 token (got {seq_len})"
        )
    with torch.random.fork_rng():  # seeded weights without disturbing the caller's global RNG
        torch.manual_seed(seed)
        module = MultiHeadAttention(d_model, n_heads).eval()
        x = torch.randn(1, seq_len, d_model)
    t, h, d_k = seq_len, n_heads, d_model // n_heads
    steps: list[tuple[str, str, tuple[int, ...]]] = []

    def step(name: str, formula: str, tensor: torch.Tensor) -> torch.Tensor:
        """Record a step's name, formula and shape; pass the tensor through."""
        steps.append((name, formula, tuple(tensor.shape)))
        return tensor

    with torch.no_grad():
        xs = step("X", "input: one d_model vector per token", x[0])
        # nn.Linear stores W as (out, in) and computes x Wᵀ + b.
        q = step("Q", "X W_Q + b_Q   (q_proj)", xs @ module.q_proj.weight.T + module.q_proj.bias)
        k = step("K", "X W_K + b_K   (k_proj)", xs @ module.k_proj.weight.T + module.k_proj.bias)
        v = step("V", "X W_V + b_V   (v_proj)", xs @ module.v_proj.weight.T + module.v_proj.bias)
        # Head i owns columns i·d_k … (i+1)·d_k − 1 of Q, K, V: a view, then heads to the front.
        qh = step("Q per head", f"reshape (T, h, d_k), transpose → (h, T, d_k), d_k = {d_k}",
                  q.view(t, h, d_k).transpose(0, 1))  # fmt: skip
        kh = step("K per head", "same split", k.view(t, h, d_k).transpose(0, 1))
        vh = step("V per head", "same split", v.view(t, h, d_k).transpose(0, 1))
        scores = step("scores", f"Q_h K_hᵀ / √{d_k}, every head at once", qh @ kh.transpose(-2, -1) / math.sqrt(d_k))
        weights = step("weights", "softmax over the keys (rows sum to 1)", torch.softmax(scores, dim=-1))
        context = step("context per head", "weights V_h", weights @ vh)
        concat = step("concatenated", "transpose → (T, h, d_k), reshape", context.transpose(0, 1).reshape(t, d_model))
        out = step("output", "concat W_O + b_O   (out_proj)", concat @ module.out_proj.weight.T + module.out_proj.bias)
        with record_attention() as recorder:
            expected = module(x)
        expected_weights = recorder.weights_of()[0]
    diff = float((out - expected[0]).abs().max())
    weights_diff = float((weights - expected_weights[0]).abs().max())
    if diff > tolerance or weights_diff > tolerance:
        # A verification, not an illustration: a mismatch means the walkthrough no longer describes qkv.
        raise RuntimeError(f"step-by-step multi-head attention differs from the module by {diff:.3g}")
    tokens = [WORDS[i] if i < len(WORDS) else f"t{i}" for i in range(seq_len)]
    n_params = sum(p.numel() for p in module.parameters())
    return HeadsResult(steps, tokens, weights.numpy(), out.numpy(), diff, weights_diff, n_params)


def plot(result: HeadsResult, path: str | Path | None, tokens: Sequence[str] | None = None) -> Figure:
    """The per-head weights as a grid of heat maps (PNG; path None: no file)."""
    labels = list(tokens) if tokens is not None else result.tokens
    h, t, _ = result.weights.shape
    d_model = result.output.shape[1]
    fig = head_grid(result.weights, labels, labels, f"{h} heads of MultiHeadAttention(d_model={d_model}, h={h}) "
                    f"(untrained) on random inputs: one ({t}, {t}) weight matrix per head", annotate=t <= 8,
                    vmax=None)  # fmt: skip
    return save(fig, path)


def run(out_dir: Path, seq_len: int = 6, d_model: int = 512, n_heads: int = 8, seed: int = 0) -> Section:
    """Run the experiment with these options, write heads.png, return the section for the report."""
    result = heads(seq_len, d_model, n_heads, seed)
    path = out_dir / "heads.png"
    plot(result, path)
    return Section("heads", TITLE, EXPLANATION, [result.table()], [path])
