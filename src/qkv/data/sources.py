"""A corpus on disk, read as a stream of chunks: text files, directories, globs, .gz, JSON Lines, Parquet.

Memory does not grow with the corpus: files are read in blocks of BLOCK_BYTES, and every chunk handed on
is about that size. What a document is:
- a JSON Lines row (its --text-field) or a Parquet row (its --column) is one document;
- a text file is one document, or several where --separator splits it (the separator itself is dropped).
A text is decoded as UTF-8 (a leading byte-order mark dropped, \\r\\n and \\r read as \\n, as qkv always
has); a byte sequence that is not UTF-8 stops with its byte offset, or becomes U+FFFD with errors="replace".

A long document is cut into pieces at places where a byte-level BPE splits anyway, so that encoding the
pieces gives the tokens of the whole (see `safe_cut`). Each chunk says where reading resumes after it
(`Position`), which is how a killed `qkv prepare` continues where it stopped.
"""

from __future__ import annotations

import codecs
import glob
import gzip
import hashlib
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, cast

from qkv.errors import QkvError
from qkv.io.files import file_sha256

BLOCK_BYTES = 1 << 22  # 4 MiB of input per chunk
MAX_PIECE_CHARS = 1 << 24  # a piece with no safe cut in it is cut here anyway (16 Mi characters without a space)
JSONL_SUFFIXES = (".jsonl", ".ndjson", ".jsonl.gz", ".ndjson.gz")
PARQUET_SUFFIXES = (".parquet",)


@dataclass(frozen=True)
class ReadOptions:
    """How to read documents out of the inputs."""

    text_field: str = "text"  # JSON Lines
    column: str = "text"  # Parquet
    separator: str | None = None  # text files: the string between documents (none: a file is a document)
    errors: str = "strict"  # bytes that are not UTF-8: "strict" (stop, naming the offset) or "replace"
    # Long documents are cut into pieces where GPT-2's pre-tokenizer splits anyway (see safe_cut): right for the
    # char tokenizer and byte-level BPEs, not for others, whose documents are read whole (qkv.data.prepare decides).
    cut_documents: bool = True

    def __post_init__(self) -> None:
        """Refuse an unknown error policy, and a separator that is empty or could never match."""
        if self.errors not in ("strict", "replace"):
            raise QkvError(f"--errors must be strict or replace, got {self.errors!r}")
        if self.separator == "":
            raise QkvError("--separator is empty; give the text that separates documents")
        if self.separator is not None and "\r" in self.separator:
            raise QkvError("--separator is matched in text whose line breaks are read as \\n; write \\n, not \\r")


def as_read(text: str) -> str:
    """Text with its line breaks as qkv reads them: \\r\\n and \\r become \\n, as text-mode open() does, so that a
    file's tokens do not depend on the system it was saved on."""
    return text.replace("\r\n", "\n").replace("\r", "\n")


def not_utf8(source: str, bad: bytes, offset: int, where: str = "") -> QkvError:
    """The one-line error for a byte that is not UTF-8 at `offset` (`where`: " of its decompressed text", say)."""
    return QkvError(f"{source} is not valid UTF-8: byte 0x{bad[:1].hex()} at byte offset {offset:,}{where}; re-save "
                    "it as UTF-8, or prepare it with `qkv prepare --errors replace` (bad bytes become U+FFFD)")


@dataclass(frozen=True)
class Position:
    """A place in the corpus: chunk `chunk` of input `input` (chunks are cut the same way every time)."""

    input: int = 0
    chunk: int = 0


@dataclass
class Chunk:
    """A piece of the corpus for one worker: documents (or pieces of one), and where reading resumes after it.

    kind "text": `payload` is a list of decoded pieces, `ends[i]` whether piece i ends its document;
    kind "jsonl": `payload` is whole lines of raw bytes, every non-empty row a document;
    kind "rows": `payload` is a list of Parquet values, every non-empty one a document.
    """

    kind: str
    payload: Any
    source: str
    at: Position  # this chunk's place: reading resumes after it at Position(at.input, at.chunk + 1)
    ends: list[bool] = field(default_factory=list)
    first_line: int = 1  # jsonl: the line number of the block's first line
    offset: int = 0  # jsonl: the byte offset of the block in its (decompressed) file
    chars: int = 0  # text: characters of the file before this chunk (a single document splits by characters)
    consumed: int = 0  # bytes of the input file read when the chunk was cut (for the progress bar)
    splits: list[str] | None = None  # a single document's pieces: "train" or "val" each (set by qkv.data.prepare)


def kind_of(path: Path) -> str:
    """'jsonl', 'parquet' or 'text', by the file's name."""
    name = path.name.lower()
    if name.endswith(JSONL_SUFFIXES):
        return "jsonl"
    return "parquet" if name.endswith(PARQUET_SUFFIXES) else "text"


def expand_inputs(specs: list[str]) -> list[Path]:
    """The files that INPUT... names, in order: files as given, directories walked (sorted), globs expanded."""
    if not specs:
        raise QkvError("no inputs: give text, JSON Lines or Parquet files, directories or globs")
    found: list[Path] = []
    for spec in specs:
        path = Path(spec).expanduser()
        if path.is_file():
            found.append(path)
        elif path.is_dir():
            files = sorted(p for p in path.rglob("*") if p.is_file() and not _hidden(p.relative_to(path)))
            if not files:
                raise QkvError(f"{path} is a directory with no files in it; give a directory that holds the corpus")
            found += files
        elif glob.has_magic(spec):
            matches = sorted(Path(p) for p in glob.glob(os.path.expanduser(spec), recursive=True) if Path(p).is_file())
            if not matches:
                raise QkvError(f"no file matches {spec}")
            found += matches
        else:
            raise QkvError(f"input not found: {spec}")
    return list(dict.fromkeys(p.resolve() for p in found))


def _hidden(relative: Path) -> bool:
    """A dot-file or a file under a dot-directory (.git, .cache …): not part of a corpus."""
    return any(part.startswith(".") for part in relative.parts)


def single_document(paths: list[Path], options: ReadOptions) -> bool:
    """True for one text file without a separator: its split is by characters (first 90 % train)."""
    return len(paths) == 1 and kind_of(paths[0]) == "text" and options.separator is None


class _HashingReader:
    """A binary file read through, hashing every byte it hands out (the input's sha256 costs no extra pass)."""

    def __init__(self, f: IO[bytes]) -> None:
        self.f, self.sha256, self.consumed = f, hashlib.sha256(), 0

    def read(self, n: int = -1) -> bytes:
        data = self.f.read(n)
        self.sha256.update(data)
        self.consumed += len(data)
        return data


@dataclass
class InputStats:
    """What reading an input found: its sha256 (None where it was not read to the end) and its size."""

    sha256: str | None = None
    size: int = 0


def read_chunks(paths: list[Path], options: ReadOptions, start: Position, stats: list[InputStats] | None = None,
                ) -> Iterator[Chunk]:  # fmt: skip
    """The corpus as chunks from `start` on (earlier ones are read, not handed out); stats[i] is filled in once
    input i has been read to its end."""
    for index in range(start.input, len(paths)):
        path = paths[index]
        skip = start.chunk if index == start.input else 0
        kind = kind_of(path)
        if kind == "parquet":
            chunks = _parquet_chunks(path, index, options, skip)
        else:
            raw = open(path, "rb")  # noqa: SIM115 (closed below, after the generator is done)
            hashing = _HashingReader(raw)
            gz = path.name.lower().endswith(".gz")
            stream: Any = gzip.GzipFile(fileobj=cast(Any, hashing), mode="rb") if gz else hashing
            chunks = (_jsonl_chunks(stream, path, index) if kind == "jsonl"
                      else _text_chunks(stream, path, index, options))  # fmt: skip
        try:
            for chunk in chunks:
                if kind != "parquet":
                    chunk.consumed = hashing.consumed
                if chunk.at.chunk >= skip:
                    yield chunk
            if kind != "parquet":
                while hashing.read(BLOCK_BYTES):  # the rest of a compressed file, for the hash
                    pass
        except (OSError, EOFError) as e:  # a damaged .gz
            raise QkvError(f"cannot read {path}: {e}") from e
        finally:
            if kind != "parquet":
                raw.close()
        if stats is not None:
            digest = file_sha256(path) if kind == "parquet" else hashing.sha256.hexdigest()
            stats[index] = InputStats(digest, path.stat().st_size)


def _jsonl_chunks(stream: Any, path: Path, index: int) -> Iterator[Chunk]:
    """Blocks of whole lines (raw bytes: decoded and parsed by the workers)."""
    offset, line, carry, n = 0, 1, b"", 0
    while True:
        block = stream.read(BLOCK_BYTES)
        data = carry + block
        cut = len(data) if not block else data.rfind(b"\n") + 1
        if cut == 0 and block:  # a line longer than a block: read on
            carry = data
            continue
        lines, carry = data[:cut], data[cut:]
        if lines:
            yield Chunk("jsonl", lines, str(path), Position(index, n), first_line=line, offset=offset)
            n, offset, line = n + 1, offset + len(lines), line + lines.count(b"\n")
        if not block:
            return


def _text_chunks(stream: Any, path: Path, index: int, options: ReadOptions) -> Iterator[Chunk]:
    """Decoded pieces of documents, cut at safe places; each chunk knows the characters before it."""
    decoder = codecs.getincrementaldecoder("utf-8")(options.errors)
    offset, pending, chars, n = 0, "", 0, 0
    while True:
        block = stream.read(BLOCK_BYTES)
        if offset == 0 and block.startswith(codecs.BOM_UTF8):  # a byte-order mark opens the text, it is not in it
            block, offset = block[3:], 3
        try:
            text = decoder.decode(block, final=not block)
        except UnicodeDecodeError as e:
            held = decoder.getstate()[0]
            where = " of its decompressed text" if path.name.lower().endswith(".gz") else ""
            raise not_utf8(str(path), (held + block)[e.start :], offset - len(held) + e.start, where) from None
        offset += len(block)
        pending += text
        keep_cr = bool(block) and pending.endswith("\r")  # it may be the first half of a \r\n
        body = as_read(pending[:-1] if keep_cr else pending)
        pieces, ends, rest = _cut(body, options, final=not block)
        pending = rest + ("\r" if keep_cr else "")
        if pieces:
            yield Chunk("text", pieces, str(path), Position(index, n), ends, chars=chars)
            n, chars = n + 1, chars + sum(map(len, pieces))
        if not block:
            return


def _cut(text: str, options: ReadOptions, final: bool) -> tuple[list[str], list[bool], str]:
    """Split buffered text into finished pieces (and whether each ends a document) and what stays buffered."""
    pieces: list[str] = []
    ends: list[bool] = []
    separator = options.separator
    if separator is not None:
        *docs, text = text.split(separator)
        pieces += docs
        ends += [True] * len(docs)
    if final:
        pieces.append(text)
        ends.append(True)
        return pieces, ends, ""
    if len(text) >= BLOCK_BYTES and options.cut_documents:
        # The end of the buffer may hold the start of a separator: no cut there.
        cut = safe_cut(text[: len(text) - len(separator)] if separator else text)
        if cut:
            pieces.append(text[:cut])
            ends.append(False)
            text = text[cut:]
    return pieces, ends, text


def safe_cut(text: str) -> int:
    """Where to cut a long piece of a document (0: nowhere yet): the last place a byte-level BPE's pre-tokenizer
    splits whatever surrounds it, a line break between two non-spaces, else a space before a letter."""
    at = len(text) - 1
    while (at := text.rfind("\n", 1, at)) > 0:
        if not text[at - 1].isspace() and not text[at + 1].isspace():
            return at + 1
    at = len(text) - 1
    while (at := text.rfind(" ", 1, at)) > 0:
        if not text[at - 1].isspace() and text[at + 1].isalpha():
            return at
    return len(text) if len(text) >= MAX_PIECE_CHARS else 0


def _parquet_chunks(path: Path, index: int, options: ReadOptions, skip: int) -> Iterator[Chunk]:
    """Batches of a Parquet file's text column (the first `skip` not converted: a resumed run passes them)."""
    from qkv.extras import require

    pq = require("pyarrow.parquet", "data", "reading Parquet files")
    try:
        table = pq.ParquetFile(path)
    except Exception as e:  # pyarrow's ArrowInvalid and friends
        raise QkvError(f"{path} is not a readable Parquet file: {str(e).splitlines()[0]}") from None
    names = table.schema_arrow.names
    if options.column not in names:
        raise QkvError(f"{path} has no column {options.column!r} (its columns: {', '.join(names)}); choose one with "
                       "--column")  # fmt: skip
    kind = str(table.schema_arrow.field(options.column).type)
    if kind not in ("string", "large_string", "string_view"):
        raise QkvError(f"{path}: column {options.column!r} holds {kind}, not text; choose a text column with --column")
    size, rows, done = path.stat().st_size, max(1, table.metadata.num_rows), 0
    for n, batch in enumerate(table.iter_batches(batch_size=1024, columns=[options.column])):
        done += batch.num_rows
        values = batch.column(0).to_pylist() if n >= skip else []
        yield Chunk("rows", values, str(path), Position(index, n), consumed=size * done // rows)
