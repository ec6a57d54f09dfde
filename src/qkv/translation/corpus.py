"""The German–English corpus: sentence pairs from the Ding dictionary (Debian `trans-de-en` 1.9-6).

Each dictionary line is `german :: english`; both sides hold `|`-separated sub-entries that
correspond one to one. A pair of sub-entries becomes a training pair when, after cleaning, both
sides are sentences (final '.', '!' or '?') of at least 3 words. See data/DE_EN.md.
"""

from __future__ import annotations

import functools
import gzip
import hashlib
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

import torch

from qkv.data.corpus import read_text_file
from qkv.errors import QkvError

DE_EN_RESOURCE = "de_en.tsv.gz"
DE_EN_COUNT = 19767
DE_EN_SHA256 = "ba6de7f2908dd03ad3a4bb046285c9bb508bbe0da79e53734080556548fd3f24"
TEST_SIZE = 1000
VAL_SIZE = 1000
SPLIT_SEED = 20170612  # the arXiv date of "Attention Is All You Need": any fixed seed would do

_ANNOTATION = re.compile(r"\{[^}]*\}|\[[^\]]*\]")  # {m}, {vt}, [coll.], [Br.] …
_SPACES = re.compile(r"\s+")


def clean_side(text: str) -> str:
    """Drop {…}/[…] annotations, keep the first ';' alternative, collapse whitespace."""
    text = _ANNOTATION.sub(" ", text).split(";")[0]
    return _SPACES.sub(" ", text).strip()


def _is_sentence(text: str) -> bool:
    """A sentence here: ends in '.', '!' or '?' and has at least 3 words."""
    return text.endswith((".", "!", "?")) and len(text.split()) >= 3


def parse_dictionary(lines: Iterable[str]) -> list[tuple[str, str]]:
    """(german, english) sentence pairs of Ding dictionary lines, deduplicated, in file order."""
    pairs: list[tuple[str, str]] = []
    seen: set[tuple[str, str]] = set()
    for line in lines:
        if line.startswith("#") or "::" not in line:
            continue
        german, english = line.rstrip("\n").split("::", 1)
        de_parts, en_parts = german.split("|"), english.split("|")
        if len(de_parts) != len(en_parts):  # no one-to-one correspondence to rely on
            continue
        for de_raw, en_raw in zip(de_parts, en_parts, strict=True):
            pair = (clean_side(de_raw), clean_side(en_raw))
            if _is_sentence(pair[0]) and _is_sentence(pair[1]) and pair not in seen:
                seen.add(pair)
                pairs.append(pair)
    return pairs


def pairs_to_tsv(pairs: list[tuple[str, str]]) -> bytes:
    """The shipped format: `german<TAB>english` lines, UTF-8."""
    return "".join(f"{de}\t{en}\n" for de, en in pairs).encode("utf-8")


def tsv_sha256(data: bytes) -> str:
    """sha256 of the uncompressed TSV (what DE_EN_SHA256 pins)."""
    return hashlib.sha256(data).hexdigest()


def read_packaged_tsv(name: str, sha256: str, script: str) -> list[str]:
    """The lines of a gzipped TSV in qkv.data, after checking the uncompressed bytes against their pinned sha256."""
    resource = resources.files("qkv.data").joinpath(name)
    try:
        data = gzip.decompress(resource.read_bytes())
    except (OSError, EOFError) as err:
        raise QkvError(f"cannot read the packaged corpus {name} ({err}); run {script}") from err
    if tsv_sha256(data) != sha256:
        raise QkvError(f"{name} does not match its pinned sha256; rebuild it with {script}")
    return data.decode("utf-8").splitlines()


@functools.cache
def load_de_en() -> tuple[tuple[str, str], ...]:
    """All packaged (german, english) pairs in file order, hash-checked."""
    rows = read_packaged_tsv(DE_EN_RESOURCE, DE_EN_SHA256, "scripts/build_de_en.py")
    return tuple((de, en) for de, en in (row.split("\t") for row in rows))


Pairs = list[tuple[str, str]]


@dataclass(frozen=True)
class Splits:
    """Train and validation sentence pairs, and the named test splits that `qkv eval` reports."""

    train: Pairs
    val: Pairs
    tests: dict[str, Pairs] = field(default_factory=dict)  # "test": a random sample; "books": held-out books


def combine(corpora: dict[str, Splits]) -> Splits:
    """Several corpora as one: their training and validation pairs pooled, each test split named by its corpus."""
    return Splits(
        train=[p for s in corpora.values() for p in s.train],
        val=[p for s in corpora.values() for p in s.val],
        tests={f"{name} {test}": pairs for name, s in corpora.items() for test, pairs in s.tests.items()},
    )


def split_pairs(pairs: Sequence[tuple[str, str]], held_out: int, seed: int = SPLIT_SEED) -> Splits:
    """A seeded permutation of the pairs: its first `held_out` pairs are test, the next `held_out` validation."""
    order = torch.randperm(len(pairs), generator=torch.Generator().manual_seed(seed)).tolist()
    shuffled = [pairs[i] for i in order]
    test, val = shuffled[:held_out], shuffled[held_out : 2 * held_out]
    return Splits(train=shuffled[2 * held_out :], val=val, tests={"test": test})


def split_de_en(pairs: tuple[tuple[str, str], ...] | None = None) -> Splits:
    """The fixed split of the Ding pairs: 1,000 test, 1,000 validation, the rest training."""
    assert TEST_SIZE == VAL_SIZE
    return split_pairs(load_de_en() if pairs is None else pairs, TEST_SIZE)


def read_pairs_file(path: str | Path) -> list[tuple[str, str]]:
    """`source<TAB>target` pairs, one per line, from a UTF-8 file; one-line errors for anything else."""
    text = read_text_file(path)  # missing, a directory, not UTF-8, empty: one-line errors already
    pairs = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        if "\t" not in line:
            raise QkvError(f"{path}, line {number}: no tab; each line is source<TAB>target")
        source, target = (side.strip() for side in line.split("\t", 1))
        if not source or not target or "\t" in target:
            raise QkvError(f"{path}, line {number}: each line is source<TAB>target, both non-empty, one tab")
        pairs.append((source, target))
    return pairs


def split_pairs_file(path: str | Path) -> Splits:
    """A user's pairs, split like the Ding corpus: a tenth each (at most 1,000) for test and validation."""
    pairs = read_pairs_file(path)
    held_out = min(TEST_SIZE, len(pairs) // 10)
    if held_out < 1:
        raise QkvError(f"{path} has {len(pairs)} pairs; at least 10 are needed to hold out validation and test pairs")
    return split_pairs(pairs, held_out)
