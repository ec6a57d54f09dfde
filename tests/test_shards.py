"""Tests for qkv.data.shards: llm.c's .bin format, byte for byte, and one-line errors for damaged shards."""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qkv.data.shards import ShardWriter, magic_for, read_header
from qkv.errors import QkvError


def spec_shard(tokens: list[int], magic: int = 20240520, version: int = 1) -> bytes:
    """A shard as llm.c's dev/data/data_common.py describes it: 256 int32 (magic, version, count, zeros), then
    the tokens as little-endian uint16 (uint32 for magic 20240801). Written here without qkv's code."""
    header = struct.pack("<256i", magic, version, len(tokens), *([0] * 253))
    code = "H" if magic == 20240520 else "I"
    return header + struct.pack(f"<{len(tokens)}{code}", *tokens)


@settings(max_examples=30, deadline=None)
@given(tokens=st.lists(st.integers(0, 2**16 - 1), max_size=300))
def test_the_writer_writes_llmc_bytes_and_the_reader_reads_them(tmp_path_factory: pytest.TempPathFactory,
                                                                 tokens: list[int]) -> None:  # fmt: skip
    path = tmp_path_factory.mktemp("shard") / "train_000000.bin"
    writer = ShardWriter(path, 20240520)
    writer.write(np.array(tokens[: len(tokens) // 2], dtype=np.uint16))
    writer.write(np.array(tokens[len(tokens) // 2 :], dtype=np.uint16))
    writer.commit()
    assert path.read_bytes() == spec_shard(tokens)
    info = read_header(path)
    assert (info.magic, info.count) == (20240520, len(tokens))
    assert info.tokens().tolist() == tokens
    assert [p.name for p in path.parent.iterdir()] == ["train_000000.bin"]  # no temporary file left


def test_uint32_shards_for_large_vocabularies(tmp_path: Path) -> None:
    assert (magic_for(256), magic_for(50_257), magic_for(65_536)) == (20240520,) * 3
    assert magic_for(65_537) == magic_for(128_256) == 20240801
    path = tmp_path / "big.bin"
    path.write_bytes(spec_shard([0, 70_000, 128_255], magic=20240801, version=7))
    assert read_header(path).tokens().tolist() == [0, 70_000, 128_255]
    writer = ShardWriter(tmp_path / "mine.bin", 20240801)
    writer.write(np.array([0, 70_000, 128_255]))
    assert writer.commit().read_bytes() == path.read_bytes()


def test_a_discarded_shard_leaves_nothing(tmp_path: Path) -> None:
    writer = ShardWriter(tmp_path / "val_000000.bin", 20240520)
    writer.write(np.arange(10))
    writer.discard()
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (spec_shard([1, 2, 3])[:-1], "is truncated: 1,029 bytes, its header says 3 tokens (1,030 bytes)"),
        (spec_shard([1, 2, 3])[:100], "is truncated: 100 bytes, shorter than the 1024-byte shard header"),
        (spec_shard([1, 2, 3]) + b"\0\0", "is longer than its header says: 1,032 bytes, its header says 3 tokens"),
        (spec_shard([1, 2, 3], magic=12345), "is not a token shard: magic number 12345, expected 20240520 or 20240801"),
        (spec_shard([1, 2, 3], version=2), "has shard version 2; magic 20240520 goes with version 1"),
    ],
    ids=["one byte short", "no header", "too long", "wrong magic", "wrong version"],
)
def test_damaged_shards_are_refused_in_one_line(tmp_path: Path, data: bytes, message: str) -> None:
    path = tmp_path / "train_000000.bin"
    path.write_bytes(data)
    with pytest.raises(QkvError) as error:
        read_header(path)
    assert str(error.value).startswith(f"{path} {message}")
    assert "\n" not in str(error.value)
