"""Reading a written answer as lm-evaluation-harness's filters and exact match read it (no model: pure text).

- each extraction is a regex over the whole output (its first or last match; of a match's groups, the first that is
  not empty), "[invalid]" where nothing matches, then "take_first";
- exact match deletes each regex of `ignore` from both strings, and folds case where asked.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

FALLBACK = "[invalid]"  # lm-eval's RegexFilter's answer where its pattern does not match


@dataclass(frozen=True)
class Extraction:
    """A named way to read the answer out of an output: a regex, and which of its matches (0: first, −1: last)."""

    name: str
    pattern: str
    match: int = 0


@dataclass(frozen=True)
class Generation:
    """How a generative benchmark decodes and grades: stop strings, a token cap, extractions, exact-match rules."""

    until: tuple[str, ...]
    max_tokens: int
    extractions: tuple[Extraction, ...]
    ignore: tuple[str, ...] = ()  # regexes deleted from answer and reference before comparing
    ignore_case: bool = False


def extract(text: str, extraction: Extraction) -> str:
    """The answer `extraction` reads from `text` (lm-eval's RegexFilter), or FALLBACK."""
    found = re.findall(extraction.pattern, text)
    if not found:
        return FALLBACK
    match = found[extraction.match]
    if isinstance(match, tuple):  # several groups: the first that matched something
        match = next((group for group in match if group), FALLBACK)
    return match.strip()


def exact_match(answer: str, reference: str, generation: Generation) -> bool:
    """Whether answer equals reference after the benchmark's deletions and case folding (lm-eval's exact_match)."""
    for pattern in generation.ignore:
        answer, reference = re.sub(pattern, "", answer), re.sub(pattern, "", reference)
    if generation.ignore_case:
        answer, reference = answer.lower(), reference.lower()
    return answer == reference


def answers(outputs: Sequence[str], generation: Generation) -> dict[str, list[str]]:
    """Each extraction's answers read from the outputs (extraction name → answers)."""
    return {e.name: [extract(out, e) for out in outputs] for e in generation.extractions}


__all__ = ["FALLBACK", "Extraction", "Generation", "answers", "exact_match", "extract"]
