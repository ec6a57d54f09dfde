"""Tests for qkv.data: the embedded corpus, text files, the split, and the two batching schemes."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch

from qkv.data import (
    SHAKESPEARE_SHA256,
    eval_windows,
    load_shakespeare,
    random_batch,
    read_text_file,
)
from qkv.errors import QkvError

# ---- the corpus ------------------------------------------------------------------------------------


def test_shakespeare_corpus_is_the_pinned_text() -> None:
    text = load_shakespeare()
    data = text.encode("utf-8")
    assert len(data) == 1_130_760
    assert len(set(text)) == 78
    assert hashlib.sha256(data).hexdigest() == SHAKESPEARE_SHA256
    assert text.startswith("THE TRAGEDY OF CORIOLANUS")
    assert text.endswith("\n") and not text.endswith("\n\n")
    assert "\n\n\n" not in text


def test_shakespeare_is_cached() -> None:
    assert load_shakespeare() is load_shakespeare()


# ---- random_batch ----------------------------------------------------------------------------------


def test_random_batch_shapes_and_shift() -> None:
    data = torch.arange(500, dtype=torch.int32)  # ids equal positions, so offsets are visible
    x, y = random_batch(data, block_size=16, batch_size=8, generator=torch.Generator().manual_seed(0))
    assert x.shape == y.shape == (8, 16)
    assert x.dtype == y.dtype == torch.int64
    assert torch.equal(y[:, :-1], x[:, 1:])  # y is x shifted left by one
    assert torch.equal(y, x + 1)  # ... and continues one token further
    assert torch.equal(x - x[:, :1], torch.arange(16).expand(8, 16))  # each row is a contiguous window
    assert int(y.max()) <= 499


def test_random_batch_is_reproducible() -> None:
    data = torch.randint(0, 50, (1000,))
    a = random_batch(data, 32, 4, torch.Generator().manual_seed(123))
    b = random_batch(data, 32, 4, torch.Generator().manual_seed(123))
    c = random_batch(data, 32, 4, torch.Generator().manual_seed(124))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert not torch.equal(a[0], c[0])


def test_random_batch_uses_only_its_generator() -> None:
    data = torch.arange(1000)
    g1, g2 = torch.Generator().manual_seed(7), torch.Generator().manual_seed(7)
    x1, _ = random_batch(data, 8, 4, g1)
    torch.manual_seed(999)  # the global RNG must not matter
    x2, _ = random_batch(data, 8, 4, g2)
    assert torch.equal(x1, x2)


def test_random_batch_exact_fit_and_too_short() -> None:
    g = torch.Generator().manual_seed(0)
    x, y = random_batch(torch.arange(9), block_size=8, batch_size=3, generator=g)  # only one window fits
    assert torch.equal(x, torch.arange(8).expand(3, 8)) and torch.equal(y, x + 1)
    with pytest.raises(QkvError, match=r"block size 8 is larger than the data \(8 tokens\)"):
        random_batch(torch.arange(8), block_size=8, batch_size=3, generator=g)


# ---- eval_windows ----------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [2, 3, 8, 9, 10, 17, 33, 34, 100])
@pytest.mark.parametrize("block_size", [1, 4, 8])
@pytest.mark.parametrize("batch_size", [1, 3])
def test_eval_windows_counts_every_target_once(n: int, block_size: int, batch_size: int) -> None:
    data = torch.arange(n) * 10  # distinct values, so a target is identified by its value
    targets: list[int] = []
    for x, y in eval_windows(data, block_size, batch_size):
        assert x.shape == y.shape and x.dim() == 2
        assert x.dtype == y.dtype == torch.int64
        assert 1 <= x.shape[0] <= batch_size and 1 <= x.shape[1] <= block_size
        assert torch.equal(y, x + 10)  # every target is the token after its input
        targets += y.flatten().tolist()
    assert targets == (torch.arange(1, n) * 10).tolist()  # positions 1..n-1, each once, in order


def test_eval_windows_batching_layout() -> None:
    # 23 tokens -> 22 targets = 5 full windows of 4 + a final window of 2.
    batches = list(eval_windows(torch.arange(23), block_size=4, batch_size=2))
    assert [tuple(x.shape) for x, _ in batches] == [(2, 4), (2, 4), (1, 4), (1, 2)]
    assert batches[0][0].tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert batches[-1][0].tolist() == [[20, 21]] and batches[-1][1].tolist() == [[21, 22]]


def test_eval_windows_multiple_of_block_size_has_no_short_window() -> None:
    batches = list(eval_windows(torch.arange(17), block_size=4, batch_size=8))  # 16 targets
    assert [tuple(x.shape) for x, _ in batches] == [(4, 4)]


def test_eval_windows_rejects_bad_input_eagerly() -> None:
    with pytest.raises(QkvError, match="at least 2 tokens"):
        eval_windows(torch.arange(1), 4, 2)  # raises on the call, not on first iteration
    with pytest.raises(QkvError, match="block size"):
        eval_windows(torch.arange(10), 0, 2)


# ---- read_text_file --------------------------------------------------------------------------------


def test_read_text_file_reads_utf8(tmp_path: Path) -> None:
    path = tmp_path / "t.txt"
    path.write_bytes("\ufeffhéllo\r\nwörld\n".encode())
    assert read_text_file(path) == "héllo\nwörld\n"  # BOM dropped, line endings normalised
    assert read_text_file(str(path)) == "héllo\nwörld\n"


def test_read_text_file_missing(tmp_path: Path) -> None:
    path = tmp_path / "nope.txt"
    with pytest.raises(QkvError, match="not found") as err:
        read_text_file(path)
    assert str(path) in str(err.value)


def test_read_text_file_directory(tmp_path: Path) -> None:
    with pytest.raises(QkvError, match="is a directory"):
        read_text_file(tmp_path)


@pytest.mark.parametrize(("content", "what"), [(b"", "empty"), (b" \n\t\r\n ", "whitespace only")])
def test_read_text_file_empty(tmp_path: Path, content: bytes, what: str) -> None:
    path = tmp_path / "blank.txt"
    path.write_bytes(content)
    with pytest.raises(QkvError, match=what) as err:
        read_text_file(path)
    assert str(path) in str(err.value)


def test_read_text_file_not_utf8(tmp_path: Path) -> None:
    path = tmp_path / "latin1.txt"
    path.write_bytes(b"caf" + "é au lait".encode("latin-1"))  # é is byte 0xe9 at offset 3
    with pytest.raises(QkvError) as err:
        read_text_file(path)
    message = str(err.value)
    assert str(path) in message and "not valid UTF-8" in message
    assert "0xe9" in message and "byte offset 3" in message
    assert "\n" not in message
