"""BLEU, chrF and the paired bootstrap against sacrebleu's own scores and known cases."""

from __future__ import annotations

import pytest
import sacrebleu

from qkv.errors import QkvError
from qkv.translation.metrics import corpus_bleu, paired_bootstrap_bleu

REFS = [f"the {a} sat on the {b} near the {c} ." for a in ("cat", "dog", "bird") for b in ("mat", "rug") for c in
        ("door", "window", "fire", "table")]  # fmt: skip


def _damaged(refs: list[str], every: int) -> list[str]:
    """Every `every`-th sentence loses its last four words."""
    return [" ".join(r.split()[:-4]) if i % every == 0 else r for i, r in enumerate(refs)]


def test_delta_is_the_difference_of_sacrebleu_scores() -> None:
    worse, better = _damaged(REFS, 2), _damaged(REFS, 5)
    result = paired_bootstrap_bleu(worse, better, REFS, samples=200)
    expected = sacrebleu.corpus_bleu(better, [REFS]).score - sacrebleu.corpus_bleu(worse, [REFS]).score
    assert result.delta == pytest.approx(expected, abs=1e-9)
    assert result.delta == pytest.approx(corpus_bleu(better, REFS) - corpus_bleu(worse, REFS), abs=1e-9)
    assert 0 < result.low <= result.delta <= result.high  # a clear, consistent gain: the interval excludes 0


def test_identical_systems_have_a_zero_interval() -> None:
    hyps = _damaged(REFS, 3)
    result = paired_bootstrap_bleu(hyps, hyps, REFS, samples=100)
    assert (result.delta, result.low, result.high) == (0.0, 0.0, 0.0)


def test_a_mixed_difference_straddles_zero_and_is_seeded() -> None:
    # b is better on half the sentences and worse on the other half: no significant difference
    a = [r if i % 2 else " ".join(r.split()[:-3]) for i, r in enumerate(REFS)]
    b = [" ".join(r.split()[:-3]) if i % 2 else r for i, r in enumerate(REFS)]
    result = paired_bootstrap_bleu(a, b, REFS, samples=300, seed=1)
    assert result.low < 0 < result.high
    assert paired_bootstrap_bleu(a, b, REFS, samples=300, seed=1) == result


def test_mismatched_lengths_are_refused() -> None:
    with pytest.raises(QkvError, match="same non-zero number"):
        paired_bootstrap_bleu(REFS[:3], REFS[:2], REFS[:3])
