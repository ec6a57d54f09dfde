"""Tests for qkv.data.sources and the document parsing of qkv.data.workers: inputs, decoding, documents, pieces."""

from __future__ import annotations

import functools
import gzip
import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qkv.data import sources
from qkv.data.sources import Position, ReadOptions, expand_inputs, read_chunks, safe_cut
from qkv.data.workers import documents
from qkv.errors import QkvError
from qkv.tokenizers.gpt2 import gpt2_tokenizer


def _documents(paths: list[Path], options: ReadOptions | None = None) -> list[str]:
    """Every document of the inputs, its pieces joined."""
    options = options or ReadOptions()
    docs, current = [], ""
    for chunk in read_chunks(paths, options, Position()):
        for text, end in zip(*documents(chunk, options), strict=True):
            current += text
            if end:
                docs.append(current)
                current = ""
    assert current == ""
    return docs


def test_inputs_are_files_directories_and_globs_in_order(tmp_path: Path) -> None:
    for name in ("b/2.txt", "b/1.txt", "a.jsonl", "b/.hidden/x.txt", ".git/config", "c.txt"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("x")
    found = expand_inputs([str(tmp_path / "c.txt"), str(tmp_path / "b"), str(tmp_path / "*.jsonl")])
    assert [p.relative_to(tmp_path).as_posix() for p in found] == ["c.txt", "b/1.txt", "b/2.txt", "a.jsonl"]
    assert expand_inputs([str(tmp_path / "c.txt"), str(tmp_path / "c.txt")]) == [tmp_path / "c.txt"]
    (tmp_path / "empty").mkdir()
    for spec, message in ((tmp_path / "empty", "is a directory with no files in it"), (tmp_path / "*.md", "no file "
                          "matches"), (tmp_path / "nope.txt", "input not found")):  # fmt: skip
        with pytest.raises(QkvError, match=message):
            expand_inputs([str(spec)])


def test_text_is_decoded_as_qkv_always_has(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A byte-order mark is dropped, \\r\\n and \\r read as \\n (also when a block ends between \\r and \\n)."""
    monkeypatch.setattr(sources, "BLOCK_BYTES", 7)
    path = tmp_path / "windows.txt"
    path.write_bytes("\ufeffHello,\r\nworld\rcafé\r\n\r\nend\r".encode())
    assert _documents([path]) == ["Hello,\nworld\ncafé\n\nend\n"]


def test_a_long_document_is_read_in_pieces_that_join_to_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sources, "BLOCK_BYTES", 64)
    text = "".join(f"Line {i}: the quick brown fox.\nand more  \n\n" for i in range(200))
    path = tmp_path / "long.txt"
    path.write_text(text)
    chunks = list(read_chunks([path], ReadOptions(), Position()))
    assert len(chunks) > 20
    assert [c.at for c in chunks] == [Position(0, i) for i in range(len(chunks))]
    assert "".join(p for c in chunks for p in c.payload) == text
    assert [c.chars for c in chunks] == [sum(len(p) for c in chunks[:i] for p in c.payload) for i in range(len(chunks))]
    # From a position on, the same chunks as from the start.
    later = list(read_chunks([path], ReadOptions(), Position(0, 5)))
    assert [c.payload for c in later] == [c.payload for c in chunks[5:]]


_TEXT = st.lists(st.sampled_from([*"ab xyZ1 9'.,!\n\t\r", "é", "ß", "’", "  ", "\n\n", "'s", " 's", "—", "你"]),
                 max_size=60).map("".join)  # fmt: skip


_gpt2 = functools.cache(gpt2_tokenizer)  # one tokenizer for every example


@settings(max_examples=300, deadline=None)
@given(text=_TEXT)
def test_a_safe_cut_does_not_change_gpt2s_tokens(text: str) -> None:
    """Where safe_cut cuts, the two pieces encode to the whole's tokens (GPT-2's pre-tokenizer splits there)."""
    tokenizer = _gpt2()
    cut = safe_cut(text)
    if cut:
        left, right, whole = tokenizer.encode_ordinary([text[:cut], text[cut:], text])
        assert left + right == whole


def test_separators_split_documents_across_blocks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sources, "BLOCK_BYTES", 5)
    path = tmp_path / "docs.txt"
    path.write_text("first doc\n===\nsecond\n===\n\n===\nthird")
    assert _documents([path], ReadOptions(separator="\n===\n")) == ["first doc", "second", "", "third"]


@pytest.mark.parametrize("block", [4, 1 << 22])
def test_bytes_that_are_not_utf8_are_refused_at_their_offset_or_replaced(
    tmp_path: Path, block: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sources, "BLOCK_BYTES", block)
    path = tmp_path / "latin1.txt"
    path.write_bytes(b"\xef\xbb\xbfcaf\xc3\xa9 na\xefve")  # a BOM, é in UTF-8, then ï in Latin-1 at offset 11
    with pytest.raises(QkvError) as error:
        _documents([path])
    assert str(error.value).startswith(f"{path} is not valid UTF-8: byte 0xef at byte offset 11; re-save it as UTF-8")
    assert _documents([path], ReadOptions(errors="replace")) == ["café na\ufffdve"]


def test_json_lines_rows_are_documents(tmp_path: Path) -> None:
    rows = [{"text": "one\r\ntwo"}, {"text": ""}, {"text": None, "id": 3}, {"body": "x", "text": "last"}]
    path = tmp_path / "rows.jsonl.gz"
    with gzip.open(path, "wt", encoding="utf-8") as f:
        f.write("\ufeff" + "\n".join(json.dumps(r) for r in rows) + "\n\n")
    assert _documents([path]) == ["one\ntwo", "", "", "last"]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n\n{"content": "no text"}\n')
    with pytest.raises(QkvError, match=r"bad.jsonl line 3 has no field 'text' \(it has: content\); name the text's "
                                       r"field with --text-field"):  # fmt: skip
        _documents([bad])
    with pytest.raises(QkvError, match=r"bad.jsonl line 1 has no field 'content' \(it has: text\)"):
        _documents([bad], ReadOptions(text_field="content"))
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"text": "fine"}\n{"text": "cut off\n')
    with pytest.raises(QkvError, match=r"broken.jsonl line 2 is not valid JSON at column 10 \(unterminated string"):
        _documents([broken])


def test_parquet_rows_are_documents(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "rows.parquet"
    pq.write_table(pa.table({"id": [1, 2, 3], "content": ["a\r\nb", None, "c"]}), path)
    assert _documents([path], ReadOptions(column="content")) == ["a\nb", "", "c"]
    with pytest.raises(QkvError, match=r"rows.parquet has no column 'text' \(its columns: id, content\); choose one "
                                       r"with --column"):  # fmt: skip
        _documents([path])
    with pytest.raises(QkvError, match=r"rows.parquet: column 'id' holds int64, not text"):
        _documents([path], ReadOptions(column="id"))
