"""Tests for qkv.data.tokens: a data directory opened for training, its windows, and llm.c's own shards."""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import run_main
from hypothesis import given, settings
from hypothesis import strategies as st

from qkv.data.batches import windows_at
from qkv.data.shards import ShardInfo
from qkv.data.tokens import TokenSplit, open_data
from qkv.errors import QkvError
from qkv.training import evaluate_loss

TINY = ["--n-layers", "1", "--d-model", "16", "--n-heads", "2", "--block-size", "16", "--batch-size", "4",
        "--max-steps", "4", "--eval-interval", "2", "--sample-tokens", "0", "--device", "cpu"]  # fmt: skip


def _split(tmp: Path, sizes: list[int], vocab: int = 1000) -> tuple[TokenSplit, np.ndarray]:
    """A split of shards with these token counts (ids = positions mod vocab), and its tokens in one array."""
    infos, arrays = [], []
    for i, n in enumerate(sizes):
        tokens = (np.arange(n) + sum(sizes[:i])) % vocab
        path = tmp / f"train_{i:06d}.bin"
        path.write_bytes(struct.pack("<256i", 20240520, 1, n, *[0] * 253) + tokens.astype("<u2").tobytes())
        infos.append(ShardInfo(path, 20240520, n))
        arrays.append(tokens)
    return TokenSplit(infos, vocab), np.concatenate(arrays)


@settings(max_examples=25, deadline=None)
@given(sizes=st.lists(st.integers(0, 60), min_size=1, max_size=5), block=st.integers(1, 8))
def test_windows_lie_within_one_shard_and_are_numbered_shard_after_shard(
    tmp_path_factory: pytest.TempPathFactory, sizes: list[int], block: int
) -> None:
    split, tokens = _split(tmp_path_factory.mktemp("shards"), sizes)
    expected = [tokens[sum(sizes[:s]) + i : sum(sizes[:s]) + i + block + 1] for s, n in enumerate(sizes)
                for i in range(max(0, n - block))]  # fmt: skip
    assert split.window_count(block) == len(expected)
    if expected:
        x, y = split.windows(torch.arange(len(expected)), block)
        assert torch.equal(torch.cat([x, y[:, -1:]], dim=1), torch.tensor(np.stack(expected), dtype=torch.int64))
    assert split[3 : len(split) - 2].tolist() == tokens[3 : len(tokens) - 2].tolist()


def test_one_shard_reads_like_the_tokens_in_memory(tmp_path: Path) -> None:
    """The same draws give the windows an in-memory 1-D tensor gave (so runs on a text file keep their numbers)."""
    split, tokens = _split(tmp_path, [500])
    starts = torch.randint(split.window_count(16), (8,), generator=torch.Generator().manual_seed(3))
    x, y = split.windows(starts, 16)
    x_ref, y_ref = windows_at(torch.from_numpy(tokens), starts, 16)
    assert torch.equal(x, x_ref) and torch.equal(y, y_ref)
    model = torch.nn.Sequential(torch.nn.Embedding(1000, 8), torch.nn.Linear(8, 1000))
    assert evaluate_loss(model, split, 16, 4) == evaluate_loss(model, torch.from_numpy(tokens), 16, 4)


def _llmc_shards(directory: Path, sizes: dict[str, int], vocab: int = 50_257) -> None:
    """FineWeb-style shards as llm.c names and writes them (struct, from the format description)."""
    directory.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for name, n in sizes.items():
        tokens = rng.integers(0, vocab, n).tolist()
        header = struct.pack("<256i", 20240520, 1, n, *[0] * 253)
        (directory / name).write_bytes(header + struct.pack(f"<{n}H", *tokens))


def test_qkv_trains_on_llmc_shards_written_from_the_format_description(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = tmp_path / "fineweb10B"
    _llmc_shards(data, {"fineweb_val_000000.bin": 3000, "fineweb_train_000001.bin": 5000,
                        "fineweb_train_000002.bin": 4000})  # fmt: skip
    code, out, err = run_main(capsys, "train", "--data", str(data), *TINY, "--out-dir", str(tmp_path / "run"))
    assert code == 0, err
    assert "9,000 train / 3,000 val tokens, vocab 50257" in err
    assert json.loads((tmp_path / "run" / "config.json").read_text())["data"]["tokenizer"] == "gpt2"
    code, out, err = run_main(capsys, "eval", str(tmp_path / "run"))
    assert code == 0 and re.match(r"val loss \d+\.\d{4}", out), err


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda d: (d / "train_000000.bin").write_bytes((d / "train_000000.bin").read_bytes()[:-2]),
         "train_000000.bin is truncated: .* prepare the data again with `qkv prepare`"),
        (lambda d: _patch(d / "val_000000.bin", 0, 20240521),
         "val_000000.bin is not a token shard: magic number 20240521, expected 20240520 or 20240801"),
        (lambda d: _patch(d / "train_000000.bin", 1, 3), "train_000000.bin has shard version 3"),
        (lambda d: _foreign_ids(d / "train_000000.bin"), "train_000000.bin holds token id 50256, outside the "
         "vocabulary of 23 tokens: it was made with another tokenizer; prepare the data again with the run's "
         "tokenizer"),
        (lambda d: (d / "tokenizer.json").write_text(json.dumps({"kind": "char", "chars": list("abc")})),
         "the tokenizer files in .* are not the tokenizer its shards were made with"),
        (lambda d: (d / "meta.json").rename(d / "progress.json"),
         "holds an unfinished preparation \\(no meta.json\\); run the same `qkv prepare` command again"),
    ],
    ids=["truncated", "wrong magic", "wrong version", "id outside the vocabulary", "another tokenizer", "unfinished"],
)
def test_damaged_data_is_refused_at_train_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                      damage: object, message: str) -> None:  # fmt: skip
    data = tmp_path / "data"
    text = tmp_path / "text.txt"
    text.write_text("".join(f"line {i} of a small text\n" for i in range(400)))
    assert run_main(capsys, "prepare", str(text), "--out", str(data), "--tokenizer", "char")[0] == 0
    damage(data)  # type: ignore[operator]
    code, _, err = run_main(capsys, "train", "--data", str(data), *TINY, "--eval-tokens", "none",
                            "--out-dir", str(tmp_path / "run"))  # fmt: skip
    assert code == 2 and len(err.strip().splitlines()) <= 2, err  # the run's header line, then the one error line
    assert re.search(message, err.strip().splitlines()[-1]), err
    assert "Traceback" not in err


def _foreign_ids(path: Path) -> None:
    """The shard's tokens as if another tokenizer (GPT-2's end-of-text) had made them."""
    data = path.read_bytes()
    path.write_bytes(data[:1024] + np.full((len(data) - 1024) // 2, 50256, dtype="<u2").tobytes())


def _patch(path: Path, index: int, value: int) -> None:
    """Overwrite the int32 (index < 256) or the uint16 token (index ≥ 256, counted from the header's start)."""
    data = bytearray(path.read_bytes())
    if index < 256:
        data[4 * index : 4 * index + 4] = struct.pack("<i", value)
    else:
        at = 1024 + 2 * (index - 256)
        data[at : at + 2] = struct.pack("<H", value)
    path.write_bytes(bytes(data))


def test_a_directory_that_is_no_data_is_refused(tmp_path: Path) -> None:
    with pytest.raises(QkvError, match=r"is not a data directory \(no meta.json, no .bin shards\); prepare one with"):
        open_data(tmp_path)
