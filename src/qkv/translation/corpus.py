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
from collections.abc import Iterable
from dataclasses import dataclass
from importlib import resources

import torch

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


@functools.cache
def load_de_en() -> tuple[tuple[str, str], ...]:
    """All packaged (german, english) pairs in file order, hash-checked."""
    resource = resources.files("qkv.data").joinpath(DE_EN_RESOURCE)
    try:
        data = gzip.decompress(resource.read_bytes())
    except (OSError, EOFError) as err:
        raise QkvError(f"cannot read the packaged corpus {DE_EN_RESOURCE} ({err}); run scripts/build_de_en.py") from err
    if tsv_sha256(data) != DE_EN_SHA256:
        raise QkvError(f"{DE_EN_RESOURCE} does not match its pinned sha256; rebuild it with scripts/build_de_en.py")
    rows = data.decode("utf-8").splitlines()
    return tuple((de, en) for de, en in (row.split("\t") for row in rows))


@dataclass(frozen=True)
class Splits:
    """Train / validation / test sentence pairs."""

    train: list[tuple[str, str]]
    val: list[tuple[str, str]]
    test: list[tuple[str, str]]


def split_de_en(pairs: tuple[tuple[str, str], ...] | None = None) -> Splits:
    """The fixed split: a seeded permutation; its first 1,000 pairs are test, the next 1,000 validation."""
    pairs = load_de_en() if pairs is None else pairs
    order = torch.randperm(len(pairs), generator=torch.Generator().manual_seed(SPLIT_SEED)).tolist()
    shuffled = [pairs[i] for i in order]
    test, val = shuffled[:TEST_SIZE], shuffled[TEST_SIZE : TEST_SIZE + VAL_SIZE]
    return Splits(train=shuffled[TEST_SIZE + VAL_SIZE :], val=val, test=test)
