"""The Bible corpus: the cleaning rules on known verses, the shipped file's hash and counts, the fixed splits."""

from __future__ import annotations

from collections import Counter

import pytest
from helpers import config

from qkv.errors import QkvError
from qkv.translation.bible import (
    BIBLE_COUNT,
    HELD_OUT_BOOKS,
    PSALMS,
    clean_verses,
    load_bible,
    move_psalm_headings,
    split_bible,
)
from qkv.translation.corpus import TEST_SIZE, VAL_SIZE, split_de_en


def test_cleaning_rules_on_known_verses() -> None:
    german = {
        (1, 1, 1): "Im Anfang schuf Gott die Himmel und die Erde.",
        (19, 41, 13): "Gepriesen sei Jehova, [der] Gott Israels! Amen, ja, Amen! * * *",
        (40, 23, 14): "(*)",
        (44, 24, 7): "Lysias aber, der Oberste, kam herzu",
    }
    english = {
        (1, 1, 1): "In the beginning God created the heavens and the earth.",
        (19, 41, 13): "Blessed be Yahweh, [the] God of Israel, from everlasting and to everlasting! Amen  and Amen.",
        (40, 23, 14): '"But woe to you, scribes and Pharisees!',
        (44, 24, 7): "empty verses content detected by amos",
    }
    cleaned = clean_verses(german, english)
    assert [v.key for v in cleaned.verses] == [(1, 1, 1), (19, 41, 13)]
    assert cleaned.missing_german == [(40, 23, 14)]
    assert cleaned.missing_english == [(44, 24, 7)]
    psalm = cleaned.verses[1]
    assert psalm.german == "Gepriesen sei Jehova, der Gott Israels! Amen, ja, Amen!"
    assert psalm.english == "Blessed be Yahweh, the God of Israel, from everlasting and to everlasting! Amen and Amen."


def test_psalm_headings_move_to_their_psalm() -> None:
    english = {
        (18, 42, 17): "So Job died, being old and full of days. BOOK I Psalm 1",
        (PSALMS, 1, 1): "Blessed is the man who doesn`t walk in the counsel of the wicked,",
        (PSALMS, 2, 12): "Blessed are all those who take refuge in him. Psalm 3 A Psalm by David, when he fled.",
        (PSALMS, 3, 1): "Yahweh, how my adversaries have increased!",
    }
    moved = move_psalm_headings(english)
    assert moved[(18, 42, 17)] == "So Job died, being old and full of days."
    assert moved[(PSALMS, 1, 1)] == english[(PSALMS, 1, 1)]  # Psalm 1 has no heading
    assert moved[(PSALMS, 2, 12)] == "Blessed are all those who take refuge in him."
    assert moved[(PSALMS, 3, 1)] == "(A Psalm by David, when he fled.) Yahweh, how my adversaries have increased!"


def test_numbering_must_agree() -> None:
    with pytest.raises(QkvError, match="verse numbering"):
        clean_verses({(1, 1, 1): "a"}, {(1, 1, 2): "b"})


def test_shipped_corpus_count_and_known_verses() -> None:
    verses = load_bible()  # checks the pinned sha256
    assert len(verses) == BIBLE_COUNT
    by_key = {v.key: v for v in verses}
    assert by_key[1, 1, 1].german == "Im Anfang schuf Gott die Himmel und die Erde."
    assert by_key[1, 1, 1].english == "In the beginning God created the heavens and the earth."
    assert by_key[43, 11, 35].english == "Jesus wept."
    assert (40, 23, 14) not in by_key  # absent from the Elberfelder's source text
    assert by_key[PSALMS, 3, 1].english.startswith("(A Psalm by David, when he fled from Absalom, his son.)")
    assert by_key[PSALMS, 3, 1].german.startswith("(Ein Psalm von David, als er vor seinem Sohne Absalom floh.)")
    assert all("`" not in v.english and "[" not in v.german + v.english for v in verses)


def test_splits_are_fixed_disjoint_and_hold_out_whole_books() -> None:
    splits = split_bible()
    books = {v.key[0] for v in load_bible()}
    in_books = [(v.german, v.english) for v in load_bible() if v.key[0] in HELD_OUT_BOOKS]
    assert len(splits.tests["test"]) == TEST_SIZE and len(splits.val) == VAL_SIZE
    assert splits.tests["books"] == in_books and len(in_books) == 1024
    assert len(splits.train) + 2 * TEST_SIZE + len(in_books) == BIBLE_COUNT
    assert set(HELD_OUT_BOOKS) <= books
    every = Counter((v.german, v.english) for v in load_bible())  # repeated verses ("Then Job answered,") repeat
    assert Counter(splits.train) + Counter(splits.val) + Counter(splits.tests["test"]) + Counter(in_books) == every
    assert split_bible().tests["test"] == splits.tests["test"]  # seeded: the same every time


def test_corpus_option() -> None:
    assert config("translate", corpus="bible").splits().tests["test"] == split_bible().tests["test"]
    bible, ding, both = split_bible(), split_de_en(), config("translate", corpus="ding+bible").splits()
    assert both.train == bible.train + ding.train and both.val == bible.val + ding.val  # pooled, nothing lost
    assert both.tests == {"bible test": bible.tests["test"], "bible books": bible.tests["books"],
                          "ding test": ding.tests["test"]}  # each corpus's own test splits, named  # fmt: skip
    with pytest.raises(QkvError, match=r"--corpus must be one of ding, bible, ding\+bible, got .wiki."):
        config("translate", corpus="wiki")
    with pytest.raises(QkvError, match="give one"):
        config("translate", corpus="bible", data="pairs.tsv")
