"""Token shards in llm.c's `.bin` format, the one llm.c and modded-nanogpt read and write.

A shard is a 1,024-byte header of 256 little-endian int32 values, then the tokens, little-endian:

    header[0]  magic     20240520 (uint16 tokens, "gpt-2")  or  20240801 (uint32 tokens, "llama-3")
    header[1]  version   1                                  or  7
    header[2]  count     the number of tokens after the header
    header[3:] zero

so a shard of n tokens is exactly 1024 + n · 2 (or n · 4) bytes. qkv writes uint16 whenever the
vocabulary fits (up to 65,536 tokens, GPT-2's 50,257 included) and uint32 above. Reading checks the header
and the file's size only; the tokens are memory-mapped, never read whole.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np

from qkv.errors import QkvError

HEADER_INTS = 256
HEADER_BYTES = HEADER_INTS * 4
# magic → (version, token dtype): llm.c's dev/data/data_common.py, HEADERS_INFO.
FORMATS: dict[int, tuple[int, np.dtype]] = {
    20240520: (1, np.dtype("<u2")),
    20240801: (7, np.dtype("<u4")),
}
MAX_TOKENS = 2**31 - 1  # header[2] is an int32


def magic_for(vocab_size: int) -> int:
    """The magic number of the narrowest token type that holds ids below vocab_size."""
    if vocab_size <= 2**16:
        return 20240520
    if vocab_size <= 2**32:
        return 20240801
    raise QkvError(f"a vocabulary of {vocab_size:,} tokens does not fit llm.c's shard formats (uint16, uint32)")


def dtype_of(magic: int) -> np.dtype:
    """The token type of a shard format."""
    return FORMATS[magic][1]


def header(magic: int, count: int) -> bytes:
    """The 1,024-byte header of a shard of `count` tokens."""
    if not 0 <= count <= MAX_TOKENS:
        raise QkvError(f"a shard holds at most {MAX_TOKENS:,} tokens, got {count:,}")
    values = np.zeros(HEADER_INTS, dtype="<i4")
    values[:3] = (magic, FORMATS[magic][0], count)
    return values.tobytes()


@dataclass(frozen=True)
class ShardInfo:
    """What a shard's header says, checked against its size."""

    path: Path
    magic: int
    count: int

    @property
    def dtype(self) -> np.dtype:
        """uint16 or uint32, little-endian."""
        return dtype_of(self.magic)

    def tokens(self) -> np.ndarray:
        """The tokens, memory-mapped read-only: pages are read when a window touches them."""
        if self.count == 0:  # numpy cannot map zero bytes
            return np.zeros(0, self.dtype)
        return np.memmap(self.path, dtype=self.dtype, mode="r", offset=HEADER_BYTES, shape=(self.count,))


def read_header(path: Path) -> ShardInfo:
    """A shard's header, refused in one line (naming the file and the fix) when it is not a whole llm.c shard."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            head = f.read(HEADER_BYTES)
            size = os.fstat(f.fileno()).st_size
    except OSError as e:
        raise QkvError(f"cannot read the shard {path}: {e.strerror or e}") from e
    fix = "prepare the data again with `qkv prepare`"
    if len(head) < HEADER_BYTES:
        raise QkvError(f"{path} is truncated: {size} bytes, shorter than the {HEADER_BYTES}-byte shard header; {fix}")
    magic, version, count = (int(v) for v in np.frombuffer(head, dtype="<i4", count=3))
    if magic not in FORMATS:
        known = " or ".join(str(m) for m in FORMATS)
        raise QkvError(f"{path} is not a token shard: magic number {magic}, expected {known} (llm.c's .bin format)")
    if version != FORMATS[magic][0]:
        raise QkvError(f"{path} has shard version {version}; magic {magic} goes with version {FORMATS[magic][0]}")
    expected = HEADER_BYTES + count * dtype_of(magic).itemsize
    if size != expected:
        what = "truncated" if size < expected else "longer than its header says"
        raise QkvError(f"{path} is {what}: {size:,} bytes, its header says {count:,} tokens ({expected:,} bytes); "
                       f"{fix}")  # fmt: skip
    return ShardInfo(path, magic, count)


class ShardWriter:
    """Write one shard as tokens arrive, into a hidden temporary file that becomes the shard only when closed.

    Tokens stream to disk as they come (memory does not grow with the shard); `commit` writes the header,
    fsyncs and renames, so a shard that exists is whole. `discard` (or an exception) leaves nothing behind.
    """

    def __init__(self, path: Path, magic: int) -> None:
        self.path, self.magic, self.count = Path(path), magic, 0
        self._tmp = self.path.with_name(f".{self.path.name}.tmp")
        self._file: BinaryIO = open(self._tmp, "wb")  # noqa: SIM115 (closed in commit or discard)
        self._file.write(header(magic, 0))

    def write(self, tokens: np.ndarray) -> None:
        """Append tokens (already checked to fit the format's type)."""
        self._file.write(np.ascontiguousarray(tokens, dtype=dtype_of(self.magic)).tobytes())
        self.count += len(tokens)

    def commit(self) -> Path:
        """Write the real header, flush to disk and rename into place; returns the shard's path."""
        try:
            self._file.seek(0)
            self._file.write(header(self.magic, self.count))
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()
            os.replace(self._tmp, self.path)
        except BaseException:
            self.discard()
            raise
        return self.path

    def discard(self) -> None:
        """Drop the unfinished shard."""
        if not self._file.closed:
            self._file.close()
        self._tmp.unlink(missing_ok=True)
