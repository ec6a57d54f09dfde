"""Corpus BLEU and chrF with sacrebleu (its default 13a tokenisation, so scores compare across papers).

sacrebleu is in the translate extra: pip install 'qkv[translate]'.
"""

from __future__ import annotations

from qkv.extras import require


def corpus_bleu(hypotheses: list[str], references: list[str]) -> float:
    """Corpus BLEU (0–100) of hypotheses against one reference each."""
    sacrebleu = require("sacrebleu", "translate", "BLEU")
    return float(sacrebleu.corpus_bleu(hypotheses, [references]).score)


def corpus_chrf(hypotheses: list[str], references: list[str]) -> float:
    """Corpus chrF (0–100): character n-gram F-score, kinder than BLEU to small morphological slips."""
    sacrebleu = require("sacrebleu", "translate", "chrF")
    return float(sacrebleu.corpus_chrf(hypotheses, [references]).score)
