"""Attention as contextualisation, step by step, the way a spreadsheet would lay it out.

Part 1 (no trainable weights): Q = K = V = the word embeddings. The query word's new vector is a
weighted average of every word's vector, the weights being softmax(score) of its dot products with
them. In "she sat on the river bank", "bank" ends up leaning towards *nature*; in "she deposited
money at the bank", towards *finance*: the same word, two context-mixed meanings.
Part 2 (trainable weights): X W_q, X W_k, X W_v give Q, K, V; the attention is qkv's own
scaled_dot_product_attention, with every intermediate shape printed.
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from qkv.attention import record_attention, scaled_dot_product_attention
from qkv.errors import QkvError
from qkv.lab.plotting import COLORS, Margins, Section, fmt_vector, format_table, heatmap, label, new_figure, save

if TYPE_CHECKING:
    from matplotlib.figure import Figure

TITLE = "Attention as contextualisation: a walkthrough"
EXPLANATION = (
    "Attention gives each word a new vector that mixes in the words around it. Take the query word's dot "
    "product with every word (how related they are), exponentiate, normalise so the weights sum to 1, and "
    "add up the word vectors with those weights. With hand-made embeddings whose dimensions mean "
    "[finance, nature, people, action], the ambiguous 'bank' = [1, 1, 0, 0] becomes mostly nature next to "
    "'river' and mostly finance next to 'money'. The third table is the classic spreadsheet's: \"A man has kept "
    'money in the bank", 3 unnamed numbers per word. A real layer first projects the inputs with learned '
    "matrices W_q, W_k, W_v; the second walkthrough does that and prints every shape."
)

DIMS = ("finance", "nature", "people", "action")
# Hand-made 4-d embeddings: each dimension means something, so the mixed vector can be read off.
# "bank" is exactly ambiguous (as much finance as nature); small function words barely pull.
VOCAB: dict[str, tuple[float, ...]] = {
    "she": (0.0, 0.0, 1.0, 0.0),
    "sat": (0.0, 0.3, 0.0, 1.0),
    "deposited": (1.2, 0.0, 0.0, 0.8),
    "on": (0.1, 0.1, 0.1, 0.1),
    "at": (0.1, 0.1, 0.1, 0.1),
    "the": (0.1, 0.1, 0.1, 0.1),
    "river": (0.0, 2.0, 0.0, 0.0),
    "money": (2.0, 0.0, 0.0, 0.0),
    "bank": (1.0, 1.0, 0.0, 0.0),
}
SENTENCES = {"river": "she sat on the river bank", "money": "she deposited money at the bank"}
# The classic spreadsheet's table: 8 words, each a 3-number embedding whose dimensions have no names.
CLASSIC: dict[str, tuple[float, float, float]] = {
    "A": (-0.03, -0.78, 0.006),
    "Man": (-0.024, -0.259, -0.002),
    "has": (-0.148, -0.049, -0.242),
    "kept": (-0.447, -0.265, -0.469),
    "money": (-0.207, -0.336, -0.411),
    "in": (-0.133, 0.546, 0.076),
    "the": (-0.013, 0.833, -0.044),
    "bank": (0.02, -0.286, 0.524),
}
TRAINABLE_SENTENCE = "The next day is bright"
EXP_LIMIT = 700.0  # exp(709.8) overflows float64


EXAMPLES: dict[str, list[tuple[str, tuple[float, ...]]]] = {
    **{name: [(w, VOCAB[w]) for w in sentence.split()] for name, sentence in SENTENCES.items()},
    "classic": list(CLASSIC.items()),
}  # each built-in sentence as (word, embedding) pairs


def builtin_example(name: str) -> tuple[list[str], np.ndarray]:
    """Words and embedding matrix (one row per word) of a built-in sentence: 'river', 'money' or 'classic'."""
    if name not in EXAMPLES:
        raise QkvError(f"unknown built-in sentence {name!r}; choose one of: {', '.join(EXAMPLES)}")
    return [w for w, _ in EXAMPLES[name]], np.array([v for _, v in EXAMPLES[name]])


@dataclass
class Walkthrough:
    """Every column of the spreadsheet, one row per word, and the query word's new vector."""

    words: list[str]
    embeddings: np.ndarray  # (T, d)
    query_index: int
    scale: float  # the factor applied to the dot products: 1/√d, or 1.0 with no scaling
    scores: np.ndarray  # (T,) scale · (query vector · word vector)
    exp_scores: np.ndarray  # (T,) exp(score − exp_shift)
    exp_shift: float  # 0 unless the scores were too large to exponentiate directly
    weights: np.ndarray  # (T,) normalised: sum to 1
    weighted: np.ndarray  # (T, d) weight × word vector
    context: np.ndarray  # (d,) the sum of the weighted rows
    dims: list[str] | None = None  # names of the embedding dimensions, when they have names

    @property
    def query(self) -> str:
        """The query word."""
        return self.words[self.query_index]

    def table(self) -> str:
        """The spreadsheet: one row per word, then the sum, then the query vector before and after."""
        d = self.embeddings.shape[1]
        scale_text = f"1/√{d} = {self.scale:.4f}" if math.isclose(self.scale, d**-0.5) else f"{self.scale:g}"
        exp_head = "exp(score)" if self.exp_shift == 0 else f"exp(score − {self.exp_shift:.4g})"
        rows: list[list[Any]] = [
            [("→ " if i == self.query_index else "") + w, fmt_vector(e), s, x, a, fmt_vector(v)]
            for i, (w, e, s, x, a, v) in enumerate(
                zip(self.words, self.embeddings, self.scores, self.exp_scores, self.weights, self.weighted, strict=True)
            )
        ]
        rows.append(["sum", "", "", float(self.exp_scores.sum()), float(self.weights.sum()), fmt_vector(self.context)])
        title = (
            f'query "{self.query}" (word {self.query_index}) in "{" ".join(self.words)}"; score = q·k × {scale_text}'
            + (f"; dims = [{', '.join(self.dims)}]" if self.dims else "")
        )
        sheet = format_table(["word", "vector", "score", exp_head, "weight", "weight × vector"], rows, title=title)
        names = self.dims or [f"dim {j}" for j in range(d)]
        before = self.embeddings[self.query_index]
        change = format_table(
            ["", *names],
            [[f'"{self.query}" before', *before], [f'"{self.query}" after', *self.context]],
            title="the query word's vector before and after attention (after = the sum above)",
        )
        return f"{sheet}\n\n{change}"

    def __str__(self) -> str:
        """Same as table()."""
        return self.table()


def _query_index(words: Sequence[str], query: str | int) -> int:
    """Index of the query: a word (its first occurrence) or a position."""
    if isinstance(query, str):
        if query not in words:
            raise QkvError(f"query word {query!r} is not in the sentence: {' '.join(words)}")
        return list(words).index(query)
    if not -len(words) <= query < len(words):
        raise QkvError(f"query index {query} is out of range for a sentence of {len(words)} words")
    return query % len(words)


def walkthrough(
    words: Sequence[str],
    embeddings: np.ndarray | Sequence[Sequence[float]],
    query: str | int,
    scale: bool | float = True,
    dims: Sequence[str] | None = None,
) -> Walkthrough:
    """Attention of one query word over the sentence with Q = K = V = embeddings (one row per word).

    scale: True divides the scores by √d (as attention does), False leaves them unscaled, a float
    multiplies them by that number. A query word that occurs twice means its first occurrence.
    """
    emb = np.asarray(embeddings, dtype=np.float64)
    if emb.ndim != 2 or emb.shape[0] != len(words) or emb.shape[1] < 1:
        raise QkvError(f"need one embedding row per word: {len(words)} words, embeddings of shape {emb.shape}")
    if not np.isfinite(emb).all():
        raise QkvError("embeddings must be finite numbers")
    if dims is not None and len(dims) != emb.shape[1]:
        raise QkvError(f"{len(dims)} dimension names for {emb.shape[1]}-dimensional embeddings")
    index = _query_index(words, query)
    factor = emb.shape[1] ** -0.5 if scale is True else 1.0 if scale is False else float(scale)
    scores = factor * (emb @ emb[index])  # (T,): one dot product per word
    # Spreadsheet-style, exp(score) as is; only if it would overflow (or every term underflow), shift by the max:
    # the weights are the same.
    shift = float(scores.max()) if abs(scores.max()) > EXP_LIMIT else 0.0
    exp_scores = np.exp(scores - shift)
    weights = exp_scores / exp_scores.sum()
    weighted = weights[:, None] * emb
    return Walkthrough(list(words), emb, index, factor, scores, exp_scores, shift, weights, weighted,
                       weighted.sum(axis=0), list(dims) if dims is not None else None)  # fmt: skip


def _number(cell: str, where: str) -> float:
    """A float from a file cell, or a QkvError saying where the bad cell is."""
    try:
        value = float(cell)
    except ValueError:
        raise QkvError(f"{where}: {cell.strip()!r} is not a number") from None
    if not math.isfinite(value):
        raise QkvError(f"{where}: {cell.strip()!r} is not a finite number")
    return value


def load_embeddings(path: str | Path) -> tuple[list[str], np.ndarray, list[str] | None]:
    """Words, embedding matrix and optional dimension names from a CSV or JSON file.

    CSV: one line per word in sentence order, `word,x1,x2,…`; an optional first line `word,name1,name2,…`
    names the dimensions; blank lines and lines starting with # are skipped.
    JSON: {"words": [...], "embeddings": [[...], ...], "dims": [...] (optional)}, or {"word": [x1, …], …}.
    """
    path = Path(path)
    if not path.is_file():
        raise QkvError(f"embeddings file {path} not found")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise QkvError(f"embeddings file {path} is not UTF-8 text") from None
    words, rows, dims = _parse_json(text, path) if path.suffix.lower() == ".json" else _parse_csv(text, path)
    if not words:
        raise QkvError(f"embeddings file {path} holds no words")
    widths = {len(r) for r in rows}
    if len(widths) != 1 or 0 in widths:
        raise QkvError(f"embeddings file {path}: all words need the same number (≥ 1) of values, got {sorted(widths)}")
    if dims is not None and len(dims) != len(rows[0]):
        raise QkvError(f"embeddings file {path}: {len(dims)} dimension names for {len(rows[0])} values per word")
    return words, np.array(rows), dims


def _parse_csv(text: str, path: Path) -> tuple[list[str], list[list[float]], list[str] | None]:
    """The CSV layout of load_embeddings."""
    words: list[str] = []
    rows: list[list[float]] = []
    dims = None
    for line_no, cells in enumerate(csv.reader(text.splitlines()), start=1):
        if not cells or not "".join(cells).strip() or cells[0].lstrip().startswith("#"):
            continue
        if not words and dims is None and cells[0].strip().lower() == "word":
            dims = [c.strip() for c in cells[1:]]
            continue
        if len(cells) < 2 or not cells[0].strip():
            raise QkvError(f"{path}, line {line_no}: expected `word,x1,x2,…`, got {','.join(cells)!r}")
        words.append(cells[0].strip())
        rows.append([_number(c, f"{path}, line {line_no}") for c in cells[1:]])
    return words, rows, dims


def _parse_json(text: str, path: Path) -> tuple[list[str], list[list[float]], list[str] | None]:
    """The JSON layouts of load_embeddings."""
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as err:
        raise QkvError(f"{path} is not valid JSON (line {err.lineno}, column {err.colno}: {err.msg})") from None
    if isinstance(obj, dict) and "words" in obj:
        words, vectors, dims = obj.get("words"), obj.get("embeddings"), obj.get("dims")
    elif isinstance(obj, dict):
        words, vectors, dims = list(obj), list(obj.values()), None
    else:
        raise QkvError(f"{path}: expected a JSON object, found {type(obj).__name__}")
    if not isinstance(words, list) or not all(isinstance(w, str) for w in words):
        raise QkvError(f'{path}: "words" must be a list of strings')
    if not isinstance(vectors, list) or len(vectors) != len(words):
        raise QkvError(f'{path}: "embeddings" must be a list with one vector per word ({len(words)} words)')
    if dims is not None and (not isinstance(dims, list) or not all(isinstance(d, str) for d in dims)):
        raise QkvError(f'{path}: "dims" must be a list of strings')
    rows = []
    for word, vector in zip(words, vectors, strict=True):
        if not isinstance(vector, list) or not all(isinstance(v, (int, float)) and not isinstance(v, bool)
                                                   for v in vector):  # fmt: skip
            raise QkvError(f"{path}: the vector of {word!r} must be a list of numbers")
        rows.append([_number(str(v), f"{path}, word {word!r}") for v in vector])
    return words, rows, dims


@dataclass
class TrainableWalkthrough:
    """Self-attention with trainable projections on a 5-word sentence: every intermediate tensor."""

    words: list[str]
    x: np.ndarray  # (T, d_in) input embeddings
    w_q: np.ndarray  # (d_in, d_out)
    w_k: np.ndarray
    w_v: np.ndarray
    q: np.ndarray  # (T, d_out)
    k: np.ndarray
    v: np.ndarray
    scores: np.ndarray  # (T, T) Q Kᵀ, before the 1/√d_out scale
    weights: np.ndarray  # (T, T) softmax(scores / √d_out), rows sum to 1
    context: np.ndarray  # (T, d_out)
    scaled: np.ndarray  # (T, T) what the softmax saw: scores / √d_out, −inf where the causal mask hides a word
    causal: bool = False  # whether word i attended only to words 0…i

    def table(self) -> str:
        """Each step with its shape, and the matrices with words as row labels."""
        d_in, d_out = self.w_q.shape
        steps = [
            ("X: the input embeddings, one row per word", self.x),
            ("W_q, W_k, W_v: trainable projections (one shown: W_q)", self.w_q),
            ("Q = X W_q", self.q),
            ("K = X W_k", self.k),
            ("V = X W_v", self.v),
            ("scores = Q Kᵀ (row: query word, column: key word)", self.scores),
            (
                f"weights = softmax(scores / √{d_out}) row by row" + (", causal: j > i masked" if self.causal else ""),
                self.weights,
            ),
            ("context = weights V: one new vector per word", self.context),
        ]
        parts = [f'"{" ".join(self.words)}": T = {len(self.words)} words, d_in = {d_in}, d_out = {d_out}']
        for caption, matrix in steps:
            square = matrix.shape == (len(self.words), len(self.words))
            headers = ["", *(self.words if square else [str(j) for j in range(matrix.shape[1])])]
            row_labels = [f"row {i}" for i in range(d_in)] if matrix is self.w_q else self.words
            rows = [[r, *(f"{v:.3f}" for v in row)] for r, row in zip(row_labels, matrix, strict=True)]
            parts.append(format_table(headers, rows, title=f"{caption}   shape {matrix.shape}"))
        sums = ", ".join(f"{s:.4f}" for s in self.weights.sum(axis=1))
        parts.append(f"row sums of the weights: {sums}")
        return "\n\n".join(parts)

    def __str__(self) -> str:
        """Same as table()."""
        return self.table()


def trainable_walkthrough(
    sentence: str = TRAINABLE_SENTENCE, d_in: int = 8, d_out: int = 4, seed: int = 123, causal: bool = False
) -> TrainableWalkthrough:
    """Q, K, V from seeded W_q, W_k, W_v (d_in, d_out), attended with qkv.scaled_dot_product_attention.

    causal: each word attends only to itself and the words before it (the decoder's masked self-attention).
    """
    words = sentence.split()
    if not words or d_in < 1 or d_out < 1:
        raise QkvError(f"need a non-empty sentence and positive sizes, got {sentence!r}, d_in={d_in}, d_out={d_out}")
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(len(words), d_in, generator=gen, dtype=torch.float64)
    # Scaled like nn.Linear's init, so that Q, K, V have entries of order 1.
    w_q, w_k, w_v = (torch.randn(d_in, d_out, generator=gen, dtype=torch.float64) / math.sqrt(d_in) for _ in range(3))
    q, k, v = x @ w_q, x @ w_k, x @ w_v  # (T, d_out) each
    with record_attention() as recorder:
        context = scaled_dot_product_attention(q, k, v, causal=causal)  # scale 1/√d_out
    (weights,), (scaled,) = recorder.weights_of(), recorder.scores_of()
    x_, w_q_, w_k_, w_v_, q_, k_, v_, scores_, weights_, context_, scaled_ = (
        t.numpy() for t in (x, w_q, w_k, w_v, q, k, v, q @ k.T, weights, context, scaled)
    )
    return TrainableWalkthrough(words, x_, w_q_, w_k_, w_v_, q_, k_, v_, scores_, weights_, context_, scaled_, causal)


def plot(result: Walkthrough | Sequence[Walkthrough] | TrainableWalkthrough, path: str | Path | None) -> Figure:
    """Weights and before/after vectors (a row per walkthrough), or the trainable matrices (PNG; path None: no file)."""
    if isinstance(result, TrainableWalkthrough):
        return _plot_trainable(result, path)
    items = [result] if isinstance(result, Walkthrough) else list(result)
    fig, axes = new_figure(len(items), 2, width=12, height=3.6 * len(items))
    for row, w in enumerate(items):
        ax = axes[row, 0]
        colours = [COLORS[1] if i == w.query_index else COLORS[0] for i in range(len(w.words))]
        ax.bar(range(len(w.words)), w.weights, color=colours)
        ax.set_xticks(range(len(w.words)), labels=w.words)
        label(ax, f'How much "{w.query}" attends to each word of "{" ".join(w.words)}"', "word (key)",
              "attention weight (sums to 1)")  # fmt: skip
        ax = axes[row, 1]
        d = w.embeddings.shape[1]
        names = w.dims or [f"dim {j}" for j in range(d)]
        ax.bar(np.arange(d) - 0.2, w.embeddings[w.query_index], 0.4, color=COLORS[0], label="before (its embedding)")
        ax.bar(np.arange(d) + 0.2, w.context, 0.4, color=COLORS[2], label="after attention (context vector)")
        ax.set_xticks(range(d), labels=names)
        label(ax, f'The vector of "{w.query}" before and after mixing in its context', "embedding dimension",
              "value (embedding units)")  # fmt: skip
        ax.legend(fontsize=8)
    return save(fig, path)


def _plot_trainable(result: TrainableWalkthrough, path: str | Path | None) -> Figure:
    """Scores, weights and context vectors of the trainable walkthrough as annotated heat maps."""
    fig, axes = new_figure(1, 3, width=16, height=4.6, margins=Margins(left=0.9, right=0.8, bottom=0.95, wspace=1.6))
    words = result.words
    d_out = result.w_q.shape[1]
    cols = [str(j) for j in range(d_out)]
    heatmap(axes[0, 0], result.scores, "scores = Q Kᵀ (unscaled)", "key word", "query word", words, words,
            cbar_label="score", cmap="coolwarm", annotate=True)  # fmt: skip
    heatmap(axes[0, 1], result.weights, f"weights = softmax(scores / √{d_out}); rows sum to 1", "key word",
            "query word", words, words, cbar_label="attention weight", vmin=0, vmax=1, annotate=True)  # fmt: skip
    heatmap(axes[0, 2], result.context, "context = weights V", "output dimension", "word", cols, words,
            cbar_label="value", cmap="coolwarm", annotate=True)  # fmt: skip
    return save(fig, path)


def run(
    out_dir: Path,
    embeddings: str | Path | None = None,
    query: str | None = None,
    scale: bool = True,
    seed: int = 123,
) -> Section:
    """The built-in 'bank' sentences and the classic table (or a file's), then the trainable walkthrough; two PNGs."""
    if embeddings is not None:
        words, emb, dims = load_embeddings(embeddings)
        if query is None:
            raise QkvError(f"--embeddings needs --query WORD, one of: {' '.join(words)}")
        items = [walkthrough(words, emb, query, scale, dims)]
    else:
        items = [walkthrough(*builtin_example(name), query or "bank", scale, DIMS) for name in SENTENCES]
        items.append(walkthrough(*builtin_example("classic"), query or "bank", scale))
    trainable = trainable_walkthrough(seed=seed)
    paths = [out_dir / "walkthrough.png", out_dir / "walkthrough-trainable.png"]
    plot(items, paths[0])
    plot(trainable, paths[1])
    return Section("walkthrough", TITLE, EXPLANATION, [*(w.table() for w in items), trainable.table()], paths)
