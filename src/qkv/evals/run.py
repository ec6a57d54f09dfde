"""`qkv eval --bench`: score a model on benchmarks with a progress bar, print the table, keep a JSON beside it."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from qkv.errors import QkvError
from qkv.evals.answers import answers, exact_match
from qkv.evals.data import Benchmark, Item, load_items
from qkv.evals.metrics import Measure, mean_measure, measures, predictions
from qkv.evals.models import EvalModel
from qkv.evals.scoring import Score, score_items
from qkv.io.files import atomic_write_json, load_json
from qkv.io.progress import ProgressLine, clock


def _header(bench: Benchmark, items: int, seconds: float, found: dict[str, Measure]) -> dict[str, Any]:
    """What every result in the JSON starts with: the benchmark, how many items, the time, the measures."""
    return {"title": bench.title, "split": bench.split, "items": items, "of": bench.size, "sha256": bench.sha256,
            "seconds": round(seconds, 2),
            "metrics": {k: {"value": m.value, "ci95": [m.lo, m.hi]} for k, m in found.items()}}  # fmt: skip


@dataclass
class BenchResult:
    """A benchmark's measures over the items scored, the time it took, and each item's scores."""

    bench: Benchmark
    items: list[Item]
    scores: list[list[Score]]
    measures: dict[str, Measure]
    seconds: float

    def to_json(self) -> dict[str, Any]:
        """The result as results JSON stores it: measures with intervals, and per item the choice picked."""
        picks = [predictions(item, s) for item, s in zip(self.items, self.scores, strict=True)]
        return {
            **_header(self.bench, len(self.items), self.seconds, self.measures),
            "per_item": {
                "gold": [item.gold for item in self.items],
                "pred": [p["acc"] for p in picks],
                "loglikelihood": [[round(x.logprob, 6) for x in s] for s in self.scores],
                "greedy": [[x.greedy for x in s] for s in self.scores],
            },
        }


@dataclass
class GenResult:
    """A generative benchmark's measures, time, and each item's output and the answers read from it."""

    bench: Benchmark
    items: list[Item]
    outputs: list[str]
    answers: dict[str, list[str]]  # extraction → each item's answer
    correct: dict[str, list[bool]]
    measures: dict[str, Measure]
    seconds: float

    def to_json(self) -> dict[str, Any]:
        """The result as results JSON stores it: measures with intervals, and per item what the model wrote."""
        return {
            **_header(self.bench, len(self.items), self.seconds, self.measures),
            "per_item": {
                "target": [item.requests[0][1] for item in self.items],
                "output": self.outputs,
                "answer": self.answers,
                "correct": self.correct,
            },
        }


def _generative(lm: EvalModel, bench: Benchmark, items: list[Item], batch: int,
                progress: Callable[[int], None]) -> GenResult:  # fmt: skip
    """Generate each item's answer, read it each way the benchmark reads it, and grade it."""
    from qkv.evals.generative import generate_answers

    assert bench.generation is not None
    start = time.perf_counter()
    outputs = generate_answers(lm.model, lm.tokenizer, [item.requests[0][0] for item in items], bench.generation,
                               batch, progress)  # fmt: skip
    read = answers(outputs, bench.generation)
    targets = [item.requests[0][1] for item in items]
    correct = {name: [exact_match(a, t, bench.generation) for a, t in zip(got, targets, strict=True)]
               for name, got in read.items()}  # fmt: skip
    found = {name: mean_measure([float(c) for c in marks]) for name, marks in correct.items()}
    return GenResult(bench, items, outputs, read, correct, found, time.perf_counter() - start)


def check_spelling(lm: EvalModel, bench: Benchmark, items: list[Item]) -> None:
    """Refuse a character vocabulary that cannot encode the benchmark's text: a character it never saw has no
    probability, so the benchmark cannot be scored at all (not merely badly)."""
    chars = getattr(lm.tokenizer, "chars", None)
    if chars is None:
        return
    known = set(chars)
    missing = sorted({ch for item in items for pair in item.requests for text in pair for ch in text} - known)
    if missing:
        shown = " ".join(repr(c) for c in missing[:8]) + (" …" if len(missing) > 8 else "")
        raise QkvError(f"{lm.name}'s character vocabulary cannot spell {bench.title} ({len(missing)} characters "
                       f"missing: {shown}); benchmarks need a tokenizer that encodes any text (a BPE run or a "
                       "pretrained checkpoint); score a char model with --bpb on text it can spell")  # fmt: skip


def run_benchmark(lm: EvalModel, bench: Benchmark, limit: int | None, show: ProgressLine,
                  batch: int = 32) -> BenchResult | GenResult:  # fmt: skip
    """Score one benchmark's first `limit` items (all for None); batch: sequences a generative one decodes at once."""
    if limit is not None and limit < 1:
        raise QkvError(f"--limit must be a positive number of items, got {limit}")
    items = load_items(bench)
    check_spelling(lm, bench, items)  # all of them: whether a model is scored does not depend on --limit
    items = items[:limit]
    start = time.perf_counter()

    def progress(done: int) -> None:
        elapsed = time.perf_counter() - start
        left = elapsed / done * (len(items) - done) if done else 0.0
        show.update(done / len(items), f"{bench.name} {done:,}/{len(items):,} items  {clock(elapsed)} "
                                       f"(~{clock(left)} left)", final=done == len(items))  # fmt: skip

    if bench.generation is not None:
        return _generative(lm, bench, items, batch, progress)
    scores = score_items(lm.model, lm.tokenizer, items, progress=progress)
    return BenchResult(bench, items, scores, measures(bench, items, scores), time.perf_counter() - start)


def _shown(name: str, m: Measure) -> str:
    """A measure as the table prints it: percentages ± half the interval; perplexity with its range."""
    if name == "perplexity":
        return f"{m.value:10.2f}   {m.lo:.2f} – {m.hi:.2f}"
    half = "  n/a" if math.isnan(m.hi) else f"{100 * (m.hi - m.value):5.2f}"
    return f"{100 * m.value:10.2f}   ± {half}"


def table(results: list[BenchResult | GenResult]) -> list[str]:
    """The results as printed lines: one per benchmark and measure."""
    lines = [f"{'benchmark':<14} {'split':<10} {'items':>6}  {'metric':<10} {'value':>10}   95 % interval   time"]
    for r in results:
        for i, (name, m) in enumerate(r.measures.items()):
            head = f"{r.bench.name:<14} {r.bench.split:<10} {len(r.items):>6}" if i == 0 else " " * 32
            tail = f"   {clock(r.seconds)}" if i == 0 else ""
            lines.append(f"{head}  {name:<10} {_shown(name, m):<29}{tail}".rstrip())
    return lines


def write_results(path: Path, lm: EvalModel, entries: dict[str, Any]) -> None:
    """Merge entries (benchmark or "bpb" → result) into the results JSON at path, atomically."""
    old = load_json(path) if path.is_file() else {}
    merged = {"model": lm.name, "results": {**(old.get("results") or {}), **entries}}
    try:
        atomic_write_json(path, merged)
    except OSError as err:
        raise QkvError(f"cannot write the results to {path} ({err.strerror}); pass --out FILE") from None
