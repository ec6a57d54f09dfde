"""Activations cached on disk once and re-read: the activation stream's shuffled buffers as files.

    DIR/meta.json                       what the rows are: model (path, sha256), hook, filters, data, seed, sizes,
                                        and whether every buffer is written (it is written first, then completed)
    DIR/buffer-00000.safetensors        buffer 0 of the stream, as ActivationStream.buffer(0) returns it
    ...

A cached stream serves the same rows at the same positions as the stream it was written from, so a run that reads
the cache trains exactly as one that computes the activations (and SAELens's trainer can be fed the same rows in
the same order). Writing is resumable: buffers already written are kept. Memory is one buffer either way.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch import Tensor

from qkv.errors import QkvError
from qkv.io.files import atomic_save_safetensors, atomic_write_json, load_json, load_safetensors
from qkv.sae.activations import ActivationStream, Buffered

FORMAT = "qkv-activations/1"
META_FILE = "meta.json"


def buffer_file(directory: Path, index: int) -> Path:
    """The file of buffer `index`."""
    return directory / f"buffer-{index:05d}.safetensors"


def write_cache(stream: ActivationStream, rows: int, directory: str | Path, about: dict[str, Any],
                progress: Any = None) -> Path:  # fmt: skip
    """Write the stream's first `rows` rows (whole buffers) into `directory`, with meta.json from `about` (the model
    reference, hook, filters, data). progress(done, total) is called after each buffer."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    count = -(-rows // stream.buffer_tokens)
    meta = {"format": FORMAT, "rows": count * stream.buffer_tokens, "buffer_tokens": stream.buffer_tokens,
            "seed": stream.seed, **about}  # fmt: skip
    same = {k: v for k, v in meta.items() if k != "rows"}
    if (directory / META_FILE).is_file():
        old = load_json(directory / META_FILE)
        if {k: v for k, v in old.items() if k not in ("rows", "complete")} != same:
            raise QkvError(f"{directory} holds activations of another model, hook, data or stream; give a new --out")
    elif any(directory.iterdir()):
        raise QkvError(f"{directory} is not empty and holds no activation cache; give a new --out")
    atomic_write_json(directory / META_FILE, {**meta, "complete": False})  # first: buffers are never anonymous
    for index in range(count):
        if not buffer_file(directory, index).is_file():
            atomic_save_safetensors(buffer_file(directory, index), {"rows": stream.buffer(index).contiguous()})
        if progress is not None:
            progress(index + 1, count)
    atomic_write_json(directory / META_FILE, {**meta, "complete": True})
    return directory


class CachedStream(Buffered):
    """The rows of a cache, served as ActivationStream serves them (rows, buffer)."""

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)
        if not (self.directory / META_FILE).is_file():
            raise QkvError(f"{self.directory} holds no cached activations (no {META_FILE}); write them with "
                           "`qkv interpret sae cache`")  # fmt: skip
        self.meta = load_json(self.directory / META_FILE)
        if self.meta.get("format") != FORMAT:
            raise QkvError(f"{self.directory / META_FILE} is not a qkv activation cache (format "
                           f"{self.meta.get('format')!r})")  # fmt: skip
        self.buffer_tokens = int(self.meta["buffer_tokens"])
        self.total = int(self.meta["rows"])
        if not self.meta.get("complete"):
            raise QkvError(f"{self.directory} is an unfinished cache; run the same `qkv interpret sae cache` command "
                           "again to finish it")  # fmt: skip

    def rows(self, start: int, count: int) -> Tensor:
        """(count, d) rows start … start + count − 1; a one-line error past the cache's end."""
        if start + count > self.total:
            raise QkvError(f"{self.directory} holds {self.total:,} activations and the run needs more: cache more "
                           "(--tokens) or train on fewer (--max-steps)")  # fmt: skip
        return super().rows(start, count)

    def load(self, index: int) -> Tensor:
        """Buffer `index`, read from its file."""
        return load_safetensors(buffer_file(self.directory, index))["rows"]
