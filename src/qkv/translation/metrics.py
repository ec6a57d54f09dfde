"""Corpus BLEU and chrF with sacrebleu (its default 13a tokenisation, so scores compare across papers).

The paired bootstrap tells whether one system's BLEU is above another's by more than the test set's noise.
sacrebleu is in the translate extra: pip install 'qkv[translate]'.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from qkv.errors import QkvError
from qkv.extras import require


def corpus_bleu(hypotheses: list[str], references: list[str]) -> float:
    """Corpus BLEU (0–100) of hypotheses against one reference each."""
    sacrebleu = require("sacrebleu", "translate", "BLEU")
    return float(sacrebleu.corpus_bleu(hypotheses, [references]).score)


def corpus_chrf(hypotheses: list[str], references: list[str]) -> float:
    """Corpus chrF (0–100): character n-gram F-score, kinder than BLEU to small morphological slips."""
    sacrebleu = require("sacrebleu", "translate", "chrF")
    return float(sacrebleu.corpus_chrf(hypotheses, [references]).score)


@dataclass(frozen=True)
class PairedBootstrap:
    """BLEU(b) − BLEU(a) on the whole test set, and its 95 % interval over paired resamples of the sentences."""

    delta: float
    low: float
    high: float
    samples: int

    def __str__(self) -> str:
        """'+1.23 BLEU (95 % interval +0.80 … +1.70, 1000 resamples)'."""
        return f"{self.delta:+.2f} BLEU (95 % interval {self.low:+.2f} … {self.high:+.2f}, {self.samples} resamples)"


def paired_bootstrap_bleu(
    hyps_a: list[str], hyps_b: list[str], references: list[str], samples: int = 1000, seed: int = 0
) -> PairedBootstrap:
    """Koehn's (2004) paired bootstrap: resample the test sentences with replacement, score both systems on each.

    BLEU is a corpus statistic (n-gram counts summed before the ratios), so each resample sums the
    sentences' n-gram statistics and scores the sums, as sacrebleu's own significance test does.
    """
    if not len(hyps_a) == len(hyps_b) == len(references) > 0:
        raise QkvError("the paired bootstrap needs the same non-zero number of sentences from both systems")
    sacrebleu = require("sacrebleu", "translate", "BLEU")
    bleu = sacrebleu.metrics.BLEU()
    stats_a = torch.tensor(bleu._extract_corpus_statistics(hyps_a, [references]), dtype=torch.int64)  # (N, 10)
    stats_b = torch.tensor(bleu._extract_corpus_statistics(hyps_b, [references]), dtype=torch.int64)

    def score(stats: Tensor) -> float:
        return float(bleu._compute_score_from_stats(stats.tolist()).score)

    generator = torch.Generator().manual_seed(seed)
    deltas = []
    for _ in range(samples):
        idx = torch.randint(len(references), (len(references),), generator=generator)
        deltas.append(score(stats_b[idx].sum(0)) - score(stats_a[idx].sum(0)))
    quantiles = torch.tensor([0.025, 0.975], dtype=torch.float64)
    low, high = torch.tensor(deltas, dtype=torch.float64).quantile(quantiles).tolist()
    return PairedBootstrap(score(stats_b.sum(0)) - score(stats_a.sum(0)), low, high, samples)
