"""What `qkv prepare` does with one chunk of the corpus, in a worker process: parse its documents, then scan
them (characters) or encode them (token ids). Nothing here imports torch, so a worker starts in a blink and
stays small; with `--workers 0` the same functions run in the main process.
"""

from __future__ import annotations

import codecs
import itertools
import json
import signal
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from qkv.data.sources import Chunk, ReadOptions, as_read, not_utf8
from qkv.errors import QkvError
from qkv.tokenizers import Tokenizer, load_tokenizer

T = TypeVar("T")
R = TypeVar("R")
_TOKENIZERS: dict[str, Tokenizer] = {}  # this process's tokenizer, by the directory it was loaded from


@dataclass
class Encoded:
    """A chunk's token ids, piece after piece (no end-of-text tokens: the main process adds those)."""

    tokens: np.ndarray  # (N,) the shard format's integer type
    lengths: np.ndarray  # (pieces,) tokens of each piece
    text_bytes: np.ndarray  # (pieces,) UTF-8 bytes of each piece's text
    ends: list[bool]  # whether each piece ends its document


def documents(chunk: Chunk, options: ReadOptions) -> tuple[list[str], list[bool]]:
    """A chunk's texts and whether each ends its document (every JSON Lines or Parquet row does)."""
    if chunk.kind == "text":
        return chunk.payload, chunk.ends
    if chunk.kind == "rows":
        return [as_read("" if v is None else v) for v in chunk.payload], [True] * len(chunk.payload)
    texts = [_field(line, n, at, chunk, options) for n, at, line in json_rows(chunk)]
    return texts, [True] * len(texts)


def json_rows(chunk: Chunk) -> list[tuple[int, int, bytes]]:
    """A JSON Lines block's rows, as (line index, byte offset in the block, raw line): its lines that are not blank,
    after the byte-order mark that may open the file."""
    start = 3 if chunk.offset == 0 and chunk.payload.startswith(codecs.BOM_UTF8) else 0
    rows, at = [], start
    for n, line in enumerate(chunk.payload[start:].split(b"\n")):
        if line.strip():
            rows.append((n, at, line))
        at += len(line) + 1
    return rows


def _field(line: bytes, n: int, at: int, chunk: Chunk, options: ReadOptions) -> str:
    """The text field of one JSON Lines row, or a one-line error naming the file and the line."""
    where = f"{chunk.source} line {chunk.first_line + n:,}" if chunk.first_line > 0 else chunk.source
    try:
        row = json.loads(line.decode("utf-8", options.errors))
    except UnicodeDecodeError as e:
        raise not_utf8(chunk.source, line[e.start :], chunk.offset + at + e.start) from None
    except json.JSONDecodeError as e:
        raise QkvError(f"{where} is not valid JSON at column {e.colno} ({e.msg.lower()})") from None
    if not isinstance(row, dict) or options.text_field not in row:
        fields = ", ".join(map(str, row)) if isinstance(row, dict) else type(row).__name__
        raise QkvError(f"{where} has no field {options.text_field!r} (it has: {fields}); name the text's field with "
                       "--text-field")  # fmt: skip
    text = row[options.text_field]
    if text is None:
        return ""
    if not isinstance(text, str):
        raise QkvError(f"{where}: field {options.text_field!r} holds {type(text).__name__}, not text")
    return as_read(text)


def scan(chunk: Chunk, options: ReadOptions) -> tuple[set[str], int]:
    """The distinct characters of a chunk and how many there are (a char vocabulary's pass, a single text's split)."""
    texts, _ = documents(chunk, options)
    return set().union(*map(set, texts)), sum(map(len, texts))


def count_documents(chunk: Chunk) -> int:
    """How many documents end in a chunk, without decoding it."""
    if chunk.kind == "jsonl":
        return len(json_rows(chunk))
    return sum(chunk.ends) if chunk.kind == "text" else len(chunk.payload)


def sample_texts(chunk: Chunk, options: ReadOptions, keep: list[bool] | None) -> list[str]:
    """The texts of a chunk's pieces (those with keep[i], where given) for learning a BPE."""
    texts, _ = documents(chunk, options)
    return texts if keep is None else [t for t, k in zip(texts, keep, strict=True) if k]


def encode(chunk: Chunk, options: ReadOptions, directory: str, dtype: str) -> Encoded:
    """A chunk's pieces as token ids with the tokenizer saved in `directory` (special-token strings as text)."""
    tokenizer = _TOKENIZERS.get(directory)
    if tokenizer is None:
        tokenizer = _TOKENIZERS[directory] = load_tokenizer(Path(directory))
    texts, ends = documents(chunk, options)
    encode_array = getattr(tokenizer, "encode_array", None)
    if encode_array is not None:  # the char tokenizer: numpy throughout
        arrays = [encode_array(t) for t in texts]
        lengths = np.array([len(a) for a in arrays], dtype=np.int64)
        tokens = np.concatenate(arrays).astype(dtype) if arrays else np.zeros(0, dtype)
    else:
        ids = tokenizer.encode_ordinary(texts)
        lengths = np.array([len(i) for i in ids], dtype=np.int64)
        tokens = np.fromiter(itertools.chain.from_iterable(ids), dtype=dtype, count=int(lengths.sum()))
    text_bytes = np.array([len(t.encode("utf-8", "surrogatepass")) for t in texts], dtype=np.int64)
    return Encoded(tokens, lengths, text_bytes, ends)


def ignore_interrupts() -> None:
    """A worker's start: Ctrl-C is the main process's to handle (it stops the workers), not each worker's."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def ordered_map(fn: Callable[[T], R], items: Iterable[T], pool: Any | None, depth: int) -> Iterator[tuple[T, R]]:
    """(item, fn(item)) in order, at most `depth` items in flight in the pool (None: in this process).

    Pool.imap would read the whole input ahead into its task queue; this keeps memory flat.
    """
    if pool is None:
        for item in items:
            yield item, fn(item)
        return
    pending: deque[tuple[T, Any]] = deque()
    for item in items:
        pending.append((item, pool.apply_async(fn, (item,))))
        if len(pending) >= depth:
            done, result = pending.popleft()
            yield done, result.get()
    while pending:
        done, result = pending.popleft()
        yield done, result.get()
