"""A data directory opened for training: its tokenizer, and each split as one memory-mapped sequence of tokens.

Opening reads meta.json, the tokenizer and each shard's header (qkv.data.shards checks header against
size); the tokens stay on disk until a window touches them, so a run's memory does not depend on the
size of its corpus. The sha256 values in meta.json are for `qkv prepare --verify`, not read here.

A directory of llm.c shards without meta.json (FineWeb from llm.c or modded-nanogpt: *_train_*.bin,
*_val_*.bin) opens too: magic 20240520 means GPT-2's tokens, as llm.c writes them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from qkv.data.prepare_state import FORMAT, META_FILE, PROGRESS_FILE
from qkv.data.shards import ShardInfo, read_header
from qkv.errors import QkvError
from qkv.io.files import load_json
from qkv.tokenizers import Tokenizer, load_tokenizer
from qkv.tokenizers.base import CONFIG_FILE as TOKENIZER_CONFIG_FILE
from qkv.tokenizers.base import TOKENIZER_FILE

SPLIT_NAMES = ("train", "val")


class TokenSplit:
    """The shards of one split as one sequence of token ids; windows never cross from one shard into the next."""

    def __init__(self, shards: Sequence[ShardInfo], vocab_size: int) -> None:
        self.shards = list(shards)
        self.vocab_size = vocab_size
        self.sizes = np.array([s.count for s in self.shards], dtype=np.int64)
        self.offsets = np.concatenate([[0], np.cumsum(self.sizes)])  # where each shard starts in the sequence
        self._per_shard: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    @cached_property
    def arrays(self) -> list[np.ndarray]:
        """Each shard's tokens, memory-mapped (mapped on first use)."""
        return [s.tokens() for s in self.shards]

    def __len__(self) -> int:
        """Tokens in the split."""
        return int(self.offsets[-1])

    def window_count(self, block_size: int) -> int:
        """How many windows of block_size + 1 tokens start in the split (each within one shard)."""
        return int(self._windows_per_shard(block_size)[0].sum())

    def windows(self, starts: Tensor, block_size: int) -> tuple[Tensor, Tensor]:
        """The windows numbered `starts` (0 … window_count − 1, shard after shard): x (B, T) int64 tokens and y,
        x shifted left by one. With one shard, window i starts at token i, as in an in-memory sequence."""
        per_shard, bounds = self._windows_per_shard(block_size)
        index = starts.numpy()
        shard = np.searchsorted(bounds, index, side="right")  # (B,) the shard each window lies in
        local = index - (bounds[shard] - per_shard[shard])
        rows = np.empty((len(index), block_size + 1), dtype=np.int64)  # (B, T + 1)
        for row, (s, at) in enumerate(zip(shard.tolist(), local.tolist(), strict=True)):
            rows[row] = self.arrays[s][at : at + block_size + 1]
        self._check(rows, shard.tolist())
        windows = torch.from_numpy(rows)
        return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()

    def _windows_per_shard(self, block_size: int) -> tuple[np.ndarray, np.ndarray]:
        """How many windows start in each shard, and their running total (worked out once per block size)."""
        if block_size not in self._per_shard:
            per_shard = np.maximum(self.sizes - block_size, 0)
            self._per_shard[block_size] = per_shard, np.cumsum(per_shard)
        return self._per_shard[block_size]

    def __getitem__(self, item: slice) -> Tensor:
        """Tokens [start, stop) of the split as an int64 tensor (read across shards)."""
        start, stop, step = item.indices(len(self))
        if step != 1:
            raise QkvError("a token split is read in contiguous slices")
        parts = []
        first = int(np.searchsorted(self.offsets, start, side="right")) - 1
        for s in range(max(first, 0), len(self.shards)):
            lo, hi = int(self.offsets[s]), int(self.offsets[s + 1])
            if lo >= stop:
                break
            if hi > start:
                part = self.arrays[s][max(start, lo) - lo : min(stop, hi) - lo]
                self._check(part, [s])
                parts.append(part)
        return torch.from_numpy(np.concatenate(parts, dtype=np.int64) if parts else np.zeros(0, dtype=np.int64))

    def _check(self, tokens: np.ndarray, shards: list[int]) -> None:
        """A one-line error naming the shard when a token id is outside the vocabulary."""
        if tokens.size and int(tokens.max()) >= self.vocab_size:
            bad = next(s for s in dict.fromkeys(shards) if self.arrays[s].size and int(self.arrays[s].max(initial=0))
                       >= self.vocab_size)  # fmt: skip
            raise QkvError(f"{self.shards[bad].path} holds token id {int(self.arrays[bad].max())}, outside the "
                           f"vocabulary of {self.vocab_size:,} tokens: it was made with another tokenizer; prepare "
                           "the data again with the run's tokenizer")  # fmt: skip

    def check_ids(self, sample: int = 1 << 20) -> None:
        """Refuse a shard whose first or last `sample` tokens hold an id outside the vocabulary, before training
        starts (a shard made with another tokenizer shows it at once); windows are checked again as they are read."""
        for s, array in enumerate(self.arrays):
            self._check(np.concatenate([array[:sample], array[-sample:]]), [s])

    def dim(self) -> int:
        """1: a split is a 1-D sequence (so it passes where a 1-D tensor of ids does)."""
        return 1


@dataclass
class TokenData:
    """A data directory: its meta.json (or what llm.c shards tell), tokenizer and splits."""

    directory: Path
    meta: dict[str, Any]
    tokenizer: Tokenizer

    @property
    def fingerprint(self) -> str:
        """The tokenizer's fingerprint, as meta.json records it."""
        return str(self.meta["tokenizer"]["fingerprint"])

    _splits: dict[str, TokenSplit] = field(default_factory=dict, init=False, repr=False)

    def split(self, name: str) -> TokenSplit:
        """The train or val split, its shards' headers checked on first use."""
        if name not in self._splits:
            infos = [read_header(self.directory / f["file"]) for f in self.meta["files"] if f["split"] == name]
            for info, f in zip(infos, [f for f in self.meta["files"] if f["split"] == name], strict=True):
                if "tokens" in f and info.count != f["tokens"]:
                    raise QkvError(f"{info.path} holds {info.count:,} tokens, {self.directory / META_FILE} says "
                                   f"{f['tokens']:,}: the directory was changed; prepare it again")  # fmt: skip
            if not infos:
                raise QkvError(f"{self.directory} has no {name} shards")
            self._splits[name] = TokenSplit(infos, self.tokenizer.vocab_size)
        return self._splits[name]

    def describe(self) -> str:
        """'1,017,684 train / 113,076 val tokens, vocab 78'."""
        splits = self.meta["splits"]
        return (f"{splits['train']['tokens']:,} train / {splits['val']['tokens']:,} val tokens, vocab "
                f"{self.tokenizer.vocab_size}")  # fmt: skip


def open_data(directory: str | Path) -> TokenData:
    """A prepared data directory (or a directory of llm.c shards), refused in one line when it cannot be trained on."""
    directory = Path(directory)
    if not directory.is_dir():
        raise QkvError(f"data directory not found: {directory}")
    if (directory / META_FILE).is_file():
        meta = load_json(directory / META_FILE)
        if meta.get("format") != FORMAT:
            raise QkvError(f"{directory / META_FILE} is not a qkv data description (format {meta.get('format')!r})")
        tokenizer = load_tokenizer(directory)
        if tokenizer.fingerprint() != meta["tokenizer"]["fingerprint"]:
            raise QkvError(f"the tokenizer files in {directory} are not the tokenizer its shards were made with "
                           f"({meta['tokenizer']['name']}); prepare the data again")  # fmt: skip
        return TokenData(directory, meta, tokenizer)
    if (directory / PROGRESS_FILE).is_file():
        raise QkvError(f"{directory} holds an unfinished preparation (no {META_FILE}); run the same `qkv prepare` "
                       "command again to finish it")  # fmt: skip
    own = sorted(p.name for p in directory.iterdir() if p.name in (TOKENIZER_FILE, TOKENIZER_CONFIG_FILE))
    if own:  # llm.c's shards come alone: a tokenizer beside them says `qkv prepare` wrote them, and meta.json went
        raise QkvError(f"{directory} has shards and {', '.join(own)} but no {META_FILE}: without it the shards' "
                       f"tokenizer and splits are unknown; prepare the data again (`qkv prepare INPUT... --out DIR`)")
    return _llmc_dir(directory)


def _llmc_dir(directory: Path) -> TokenData:
    """A directory of llm.c's .bin shards: split by file name (*train*, *val*), GPT-2's tokenizer for uint16."""
    shards = sorted(directory.glob("*.bin"))
    if not shards:
        raise QkvError(f"{directory} is not a data directory (no {META_FILE}, no .bin shards); prepare one with "
                       f"`qkv prepare INPUT... --out {directory}`")  # fmt: skip
    files: list[dict[str, Any]] = []
    for path in shards:
        split = "val" if "val" in path.stem else "train" if "train" in path.stem else None
        if split is None:
            raise QkvError(f"{path}: llm.c shards are named *train*.bin or *val*.bin; rename it to say its split")
        info = read_header(path)
        if info.magic != 20240520:
            raise QkvError(f"{path} holds uint32 tokens (magic {info.magic}, llm.c's Llama-3 shards) and no "
                           f"{META_FILE} names their tokenizer; qkv reads those it prepared itself")  # fmt: skip
        files.append({"file": path.name, "split": split, "tokens": info.count})
    from qkv.tokenizers.gpt2 import gpt2_tokenizer

    tokenizer = gpt2_tokenizer()
    totals = {s: sum(f["tokens"] for f in files if f["split"] == s) for s in SPLIT_NAMES}
    meta = {"format": FORMAT, "files": files, "splits": {s: {"tokens": totals[s]} for s in SPLIT_NAMES},
            "tokenizer": {"name": "gpt2", "kind": "bpe", "vocab_size": tokenizer.vocab_size,
                          "eos_id": tokenizer.eos_id, "fingerprint": tokenizer.fingerprint()}}  # fmt: skip
    return TokenData(directory, meta, tokenizer)


def verify_data(directory: Path) -> str:
    """Check every shard of a data directory against meta.json (header, size, sha256, token ids); a summary."""
    from qkv.io.files import file_sha256

    data = open_data(directory)
    tokens = 0
    for f in data.meta["files"]:
        info = read_header(directory / f["file"])
        if info.count != f["tokens"]:
            raise QkvError(f"{info.path} holds {info.count:,} tokens, meta.json says {f['tokens']:,}")
        if "sha256" in f and file_sha256(info.path) != f["sha256"]:
            raise QkvError(f"{info.path} does not match the sha256 in meta.json: it changed since it was prepared")
        array = info.tokens()
        for start in range(0, info.count, 1 << 26):
            top = int(array[start : start + (1 << 26)].max())
            if top >= data.tokenizer.vocab_size:
                raise QkvError(f"{info.path} holds token id {top}, outside the vocabulary of "
                               f"{data.tokenizer.vocab_size:,} tokens")  # fmt: skip
        tokens += info.count
    files = len(data.meta["files"])
    shards = f"{files} shard{'s' if files != 1 else ''}"
    return f"{directory}: {shards}, {tokens:,} tokens, sizes, hashes and token ids as meta.json says"
