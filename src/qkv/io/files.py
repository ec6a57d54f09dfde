"""Files that cannot be half-written and cannot run code: atomic writes, JSON and safetensors loading.

Nothing here ever calls ``pickle`` or ``torch.load``: a file downloaded from a stranger cannot execute
code. Every reader turns a missing, truncated or foreign file into a one-line QkvError.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import struct
import tempfile
from collections.abc import Iterable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from qkv.errors import QkvError

if TYPE_CHECKING:  # imported where tensors are written or read: `qkv prepare` never loads torch
    from torch import Tensor

PICKLE_SUFFIXES = frozenset({".pt", ".pth", ".bin", ".pkl", ".pickle", ".ckpt"})


@contextmanager
def atomic_path(path: Path) -> Iterator[Path]:
    """A new temporary file beside ``path`` to write; when the block ends it is synced and renamed onto ``path``
    (readers see the old file or the new one, never half), and if the block raises it is removed."""
    path = Path(path)
    tmp = _temp_beside(path)
    try:
        yield tmp
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())  # data on disk *before* the rename makes it visible
        # mkstemp creates 0600 files; keep the permissions a plain open() would have given.
        os.chmod(tmp, path.stat().st_mode & 0o777 if path.exists() else 0o644)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_directory(path.parent)


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` so that readers see either the old file or the new one, never half."""
    with atomic_path(path) as tmp:
        tmp.write_bytes(data)


def fsync_directory(directory: Path) -> None:
    """Persist a rename by fsyncing its directory (a no-op where the OS does not support it)."""
    if os.name != "posix":
        return
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError:
        pass  # some filesystems refuse fsync on directories; the rename itself already happened
    finally:
        os.close(fd)


def atomic_write_json(path: Path, obj: Any, *, sort_keys: bool = False) -> None:
    """Atomically write ``obj`` as indented UTF-8 JSON (non-ASCII characters kept as themselves)."""
    try:
        text = json.dumps(obj, indent=2, sort_keys=sort_keys, ensure_ascii=False)
    except (TypeError, ValueError) as e:
        raise QkvError(f"cannot write {path}: value is not JSON-serialisable ({e})") from e
    atomic_write_bytes(Path(path), (text + "\n").encode("utf-8"))


def atomic_save_safetensors(path: Path, tensors: dict[str, Tensor], metadata: dict[str, str] | None = None) -> str:
    """Atomically write ``tensors`` as a safetensors file; returns the file's sha256 hex digest."""
    import safetensors.torch

    prepared: dict[str, Tensor] = {}
    seen_storages: set[int] = set()
    for name, t in tensors.items():
        t = t.detach().cpu().contiguous()
        ptr = t.untyped_storage().data_ptr()
        # Tied weights (e.g. embedding == lm_head) share storage, which safetensors refuses;
        # a clone writes the bytes twice, and re-tying is the model's job after loading.
        if ptr != 0 and ptr in seen_storages:
            t = t.clone()
            ptr = t.untyped_storage().data_ptr()
        seen_storages.add(ptr)
        prepared[name] = t
    data = safetensors.torch.save(prepared, metadata=metadata)
    atomic_write_bytes(Path(path), data)
    return hashlib.sha256(data).hexdigest()


SAFETENSORS_DTYPES = {"float32": "F32", "float16": "F16", "bfloat16": "BF16", "float64": "F64", "int64": "I64",
                      "int32": "I32", "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL"}  # fmt: skip


def atomic_stream_safetensors(
    paths: list[Path], specs: list[tuple[str, Any, tuple[int, ...]]], tensors: Iterable[Tensor]
) -> None:
    """Write the same safetensors file to each of ``paths`` atomically, one tensor at a time.

    specs: (name, torch dtype, shape) of each tensor in order; tensors: their values in that order. Only one
    tensor is held at once (a sharded model gathers each in turn), where safetensors.torch.save builds the
    whole file in memory first.
    """
    import torch

    header: dict[str, Any] = {}
    offset = 0
    for name, dtype, shape in specs:
        size = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        header[name] = {"dtype": SAFETENSORS_DTYPES[str(dtype).removeprefix("torch.")], "shape": list(shape),
                        "data_offsets": [offset, offset + size]}  # fmt: skip
        offset += size
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    with ExitStack() as stack:  # every file is renamed into place only once all of them are written
        outs = [stack.enter_context(open(stack.enter_context(atomic_path(Path(p))), "wb")) for p in paths]
        for f in outs:
            f.write(struct.pack("<Q", len(head)) + head)
        for (name, dtype, shape), t in zip(specs, tensors, strict=True):
            if t.dtype != dtype or tuple(t.shape) != tuple(shape):
                raise QkvError(f"tensor {name} is {t.dtype} {tuple(t.shape)}, its header says {dtype} {shape}")
            data = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().data
            for f in outs:
                f.write(data)


def _temp_beside(path: Path) -> Path:
    """A new hidden temporary file in ``path``'s directory (os.replace is atomic within one filesystem only; the
    hidden prefix keeps it out of globs like "*.safetensors")."""
    fd, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    return Path(name)


def _read_head(path: Path, n: int, what: str) -> bytes:
    """Return the first ``n`` bytes of ``path``, refusing missing files and pickle-named files."""
    if not path.is_file():
        raise QkvError(f"{what} not found: {path}")
    if path.suffix.lower() in PICKLE_SUFFIXES:
        raise QkvError(f"refusing to load pickle file {path}: qkv only reads safetensors and JSON")
    with open(path, "rb") as f:
        return f.read(n)


def _looks_like_pickle(head: bytes) -> bool:
    """True for torch.save's zip container or a pickle stream of protocol 2 or later."""
    return head.startswith(b"PK\x03\x04") or (len(head) >= 2 and head[0] == 0x80 and 2 <= head[1] <= 5)


def _safetensors_header_problem(head: bytes, size: int) -> str | None:
    """Why ``head`` cannot start a safetensors file of ``size`` bytes, or None if it plausibly can."""
    if size < 8:
        return f"file is only {size} bytes, shorter than the 8-byte header length"
    (header_len,) = struct.unpack("<Q", head[:8])
    if header_len > size - 8:
        return f"header claims {header_len} bytes but the file has only {size - 8} after it"
    if head[8:9] != b"{":
        return "header is not a JSON object"
    return None


def load_safetensors(path: Path) -> dict[str, Tensor]:
    """Load every tensor of a safetensors file onto the CPU, with a clear error for anything else."""
    import safetensors.torch

    path = Path(path)
    head = _read_head(path, 16, "file")
    problem = _safetensors_header_problem(head, path.stat().st_size)
    # The header check runs first: a real safetensors header length can begin with 0x80 or "PK".
    if problem is not None and _looks_like_pickle(head) and head[8:9] != b"{":  # "{": a cut-short safetensors
        raise QkvError(f"refusing to load pickle file {path}: qkv only reads safetensors and JSON")
    if problem is not None and head[8:9] == b"{":
        raise QkvError(f"{path} is damaged or incomplete ({problem}); copy or write it again")
    if problem is not None:
        raise QkvError(f"{path} is not a valid safetensors file ({problem})")
    try:
        return safetensors.torch.load_file(path, device="cpu")
    except Exception as e:  # SafetensorError is not importable under a stable public name; its text is internal
        raise QkvError(f"{path} is damaged or incomplete (safetensors cannot read its tensors); copy or write it "
                       "again") from e  # fmt: skip


def load_json(path: Path, what: str = "file") -> dict[str, Any]:
    """Load a JSON file whose top level is an object; `what` names the file in the not-found message."""
    path = Path(path)
    head = _read_head(path, 4, what)
    if _looks_like_pickle(head):  # JSON text never starts with these bytes
        raise QkvError(f"refusing to load pickle file {path}: qkv only reads safetensors and JSON")
    try:
        obj = json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as e:
        raise QkvError(f"{path} is not valid JSON (not UTF-8 text at byte {e.start})") from e
    except json.JSONDecodeError as e:
        raise QkvError(f"{path} is not valid JSON (line {e.lineno}: {e.msg}, column {e.colno})") from e
    if not isinstance(obj, dict):
        raise QkvError(f"{path} must contain a JSON object at the top level, not {type(obj).__name__}")
    return obj


def file_sha256(path: Path) -> str:
    """Return the sha256 hex digest of a file, read in chunks so large checkpoints fit in memory."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()
