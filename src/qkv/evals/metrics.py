"""The benchmarks' measures from per-choice log-likelihoods, as lm-evaluation-harness 0.4 computes them.

Multiple choice:
- acc: the choice with the highest log-likelihood is the gold one;
- acc_norm: the same after dividing each log-likelihood by its choice's length in characters, so long endings
  are not penalised for having more tokens to be unlikely in;
- acc_bytes: the same, by its length in UTF-8 bytes.
LAMBADA: acc is the share of passages whose last word is the model's greedy continuation, token by token;
perplexity is exp(−mean log-likelihood of that word).

Each figure comes with a 95 % interval: ±1.96 standard errors of the mean (lm-eval's stderr, the sample
standard deviation over √n); for perplexity, exp of the interval of the mean log-likelihood.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from qkv.evals.data import Benchmark, Item
from qkv.evals.scoring import Score

Z95 = 1.959964  # two-sided 95 % quantile of the normal distribution


@dataclass(frozen=True)
class Measure:
    """A figure and its 95 % interval (lo, hi); NaN bounds when one item leaves no spread to estimate."""

    value: float
    lo: float
    hi: float


def _argmax(values: Sequence[float]) -> int:
    """The first index of the largest value (numpy's argmax, which lm-eval uses, breaks ties the same way)."""
    return max(range(len(values)), key=lambda i: (values[i], -i))


def _mean_interval(values: Sequence[float]) -> tuple[float, float]:
    """The mean and 1.96 × its standard error (NaN for fewer than two values)."""
    n = len(values)
    mean = sum(values) / n
    if n < 2:
        return mean, math.nan
    variance = sum((v - mean) ** 2 for v in values) / (n - 1)
    return mean, Z95 * math.sqrt(variance / n)


def mean_measure(values: Sequence[float]) -> Measure:
    """The mean of per-item values with its 95 % interval."""
    mean, half = _mean_interval(values)
    return Measure(mean, mean - half, mean + half)


def predictions(item: Item, scores: Sequence[Score]) -> dict[str, int]:
    """An item's chosen answer by each rule: acc's, acc_norm's and acc_bytes's."""
    lls = [s.logprob for s in scores]
    return {
        "acc": _argmax(lls),
        "acc_norm": _argmax([ll / len(c) for ll, c in zip(lls, item.choices, strict=True)]),
        "acc_bytes": _argmax([ll / len(c.encode("utf-8")) for ll, c in zip(lls, item.choices, strict=True)]),
    }


def measures(bench: Benchmark, items: Sequence[Item], scores: Sequence[Sequence[Score]]) -> dict[str, Measure]:
    """The benchmark's measures over its scored items."""
    if bench.kind == "lambada":
        lls = [s[0].logprob for s in scores]
        mean, half = _mean_interval(lls)
        return {
            "acc": mean_measure([float(s[0].greedy) for s in scores]),
            "perplexity": Measure(math.exp(-mean), math.exp(-(mean + half)), math.exp(-(mean - half))),
        }
    picks = [predictions(item, s) for item, s in zip(items, scores, strict=True)]
    return {
        rule: mean_measure([float(p[rule] == item.gold) for p, item in zip(picks, items, strict=True)])
        for rule in bench.metrics
    }
