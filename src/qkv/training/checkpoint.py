"""Crash-safe, pickle-free checkpoints: tensors in safetensors, everything else in JSON.

Nothing here ever calls ``pickle`` or ``torch.load``: a checkpoint downloaded from a stranger
cannot execute code.  Optimizer and RNG state, which PyTorch normally pickles, are split into
a flat tensor dict (safetensors) plus a small JSON-able dict.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import struct
import tempfile
from pathlib import Path
from typing import Any, Protocol

import safetensors.torch
import torch
from torch import Tensor
from torch.optim import Optimizer

from qkv.errors import QkvError
from qkv.training.train_state import (
    generator_state,
    optimizer_state_from_safetensors,
    optimizer_state_to_safetensors,
    restore_rng_state,
    rng_state_to_tensors,
    set_generator_state,
)

PICKLE_SUFFIXES = frozenset({".pt", ".pth", ".bin", ".pkl", ".pickle", ".ckpt"})
MODEL_FILE = "last.safetensors"
OPTIM_FILE = "last_optim.safetensors"
STATE_FILE = "last_state.json"
STATE_FORMAT = "qkv-training-state/1"


class StatefulOptimizer(Protocol):
    """What a checkpoint loads optimizer state into: a torch Optimizer, or an adapter that shards it."""

    def state_dict(self) -> dict[str, Any]:
        """The optimizer's state, keyed by parameter index."""

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore what state_dict returned."""


# ---------------------------------------------------------------------------------------------
# Atomic writes
# ---------------------------------------------------------------------------------------------


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` so that readers see either the old file or the new one, never half."""
    path = Path(path)
    # The temp file must live in the target's directory: os.replace is only atomic within one
    # filesystem, and a hidden prefix keeps it out of globs like "*.safetensors".
    fd, tmp_name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    tmp = Path(tmp_name)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())  # data on disk *before* the rename makes it visible
        # mkstemp creates 0600 files; keep the permissions a plain open() would have given.
        mode = path.stat().st_mode & 0o777 if path.exists() else 0o644
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_directory(path.parent)


def _fsync_directory(directory: Path) -> None:
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
    """Atomically write ``obj`` as indented UTF-8 JSON."""
    try:
        text = json.dumps(obj, indent=2, sort_keys=sort_keys)
    except (TypeError, ValueError) as e:
        raise QkvError(f"cannot write {path}: value is not JSON-serialisable ({e})") from e
    atomic_write_bytes(Path(path), (text + "\n").encode("utf-8"))


def atomic_save_safetensors(path: Path, tensors: dict[str, Tensor], metadata: dict[str, str] | None = None) -> str:
    """Atomically write ``tensors`` as a safetensors file; returns the file's sha256 hex digest."""
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


# ---------------------------------------------------------------------------------------------
# Safe loading
# ---------------------------------------------------------------------------------------------


def _read_head(path: Path, n: int) -> bytes:
    """Return the first ``n`` bytes of ``path``, refusing missing files and pickle-named files."""
    if not path.is_file():
        raise QkvError(f"file not found: {path}")
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
    path = Path(path)
    head = _read_head(path, 16)
    problem = _safetensors_header_problem(head, path.stat().st_size)
    # The header check runs first: a real safetensors header length can begin with 0x80 or "PK".
    if problem is not None and _looks_like_pickle(head):
        raise QkvError(f"refusing to load pickle file {path}: qkv only reads safetensors and JSON")
    if problem is not None:
        raise QkvError(f"{path} is not a valid safetensors file ({problem})")
    try:
        return safetensors.torch.load_file(path, device="cpu")
    except Exception as e:  # SafetensorError is not importable under a stable public name
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise QkvError(f"{path} is not a valid safetensors file ({reason})") from e


def load_json(path: Path) -> dict[str, Any]:
    """Load a JSON file whose top level is an object, with a clear error for anything else."""
    path = Path(path)
    head = _read_head(path, 4)
    if _looks_like_pickle(head):  # JSON text never starts with these bytes
        raise QkvError(f"refusing to load pickle file {path}: qkv only reads safetensors and JSON")
    try:
        obj = json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as e:
        raise QkvError(f"{path} is not valid JSON (not UTF-8 text at byte {e.start})") from e
    except json.JSONDecodeError as e:
        raise QkvError(f"{path} is not valid JSON (line {e.lineno}: {e.msg})") from e
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


# ---------------------------------------------------------------------------------------------
# Whole training state
# ---------------------------------------------------------------------------------------------


def save_training_state(
    directory: Path,
    *,
    model_state: dict[str, Tensor],
    optimizer: Optimizer | dict[str, Any],
    extra: dict[str, Any],
    generators: dict[str, torch.Generator],
) -> None:
    """Write last.safetensors, last_optim.safetensors and (last, with both hashes) last_state.json."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    optim_tensors, optim_meta = optimizer_state_to_safetensors(optimizer)
    rng_tensors, rng_meta = rng_state_to_tensors()
    side: dict[str, Tensor] = {f"optim.{k}": v for k, v in optim_tensors.items()}
    side.update({f"rng.{k}": v for k, v in rng_tensors.items()})
    side.update({f"generator.{name}": generator_state(g) for name, g in generators.items()})
    try:
        json.dumps(extra)  # fail before touching any file, not after the tensors are written
    except (TypeError, ValueError) as e:
        raise QkvError(f"cannot checkpoint extra training state: not JSON-serialisable ({e})") from e
    # Crash safety across three files: the new tensors go to hidden staged files first, and
    # last_state.json (written last, atomically) is the commit point that names their hashes.
    # Until it is replaced, the previous checkpoint is untouched; once it is, the staged files are
    # moved into place, and load_training_state finishes that move if a crash interrupted it.
    staged = {name: staged_path(directory, name) for name in (MODEL_FILE, OPTIM_FILE)}
    files: dict[str, dict[str, str]] = {}
    try:
        files[MODEL_FILE] = {"sha256": atomic_save_safetensors(staged[MODEL_FILE], model_state)}
        files[OPTIM_FILE] = {"sha256": atomic_save_safetensors(staged[OPTIM_FILE], side)}
        state = {
            "format": STATE_FORMAT,
            "files": files,
            "optimizer": optim_meta,
            "rng": rng_meta,
            "generators": sorted(generators),
            "extra": extra,
        }
        atomic_write_json(directory / STATE_FILE, state)
    except BaseException:
        if not _state_names(directory, files):  # not committed: drop the staged files, keep the old checkpoint
            for path in staged.values():
                path.unlink(missing_ok=True)
        raise
    for name, path in staged.items():
        os.replace(path, directory / name)
    _fsync_directory(directory)


def staged_path(directory: Path, name: str) -> Path:
    """Where save_training_state writes ``name`` before the checkpoint is committed."""
    return Path(directory) / f".{name}.next"


def _state_names(directory: Path, files: dict[str, dict[str, str]]) -> bool:
    """True if last_state.json in ``directory`` records exactly ``files`` (i.e. that save was committed)."""
    if len(files) != 2:
        return False
    try:
        return load_json(Path(directory) / STATE_FILE).get("files") == files
    except (QkvError, OSError):
        return False


def load_training_state(
    directory: Path, optimizer: StatefulOptimizer, generators: dict[str, torch.Generator]
) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """Restore optimizer, RNG and generator state in place; return (model_state, extra)."""
    directory = Path(directory)
    if not (directory / STATE_FILE).is_file():
        raise QkvError(f"no checkpoint to resume in {directory} ({STATE_FILE} missing)")
    state = load_json(directory / STATE_FILE)
    if state.get("format") != STATE_FORMAT:
        raise QkvError(f"{directory / STATE_FILE} has format {state.get('format')!r}, expected {STATE_FORMAT!r}")
    sources: dict[str, Path] = {}
    for name in (MODEL_FILE, OPTIM_FILE):
        expected = state.get("files", {}).get(name, {}).get("sha256")
        if expected is None:
            raise QkvError(f"{directory / STATE_FILE} has no sha256 for {name}; re-save the checkpoint")
        sources[name] = _committed_file(directory, name, expected)
    model_state = load_safetensors(sources[MODEL_FILE])
    side = load_safetensors(sources[OPTIM_FILE])
    missing = sorted(set(generators) - set(state["generators"]))
    if missing:
        raise QkvError(f"checkpoint in {directory} has no state for generator(s) {', '.join(missing)}")

    def part(prefix: str) -> dict[str, Tensor]:
        """The tensors of ``last_optim.safetensors`` under ``prefix``, with the prefix removed."""
        return {k[len(prefix) :]: v for k, v in side.items() if k.startswith(prefix)}

    optim_sd = optimizer_state_from_safetensors(part("optim."), state["optimizer"])
    try:
        optimizer.load_state_dict(optim_sd)
    except (ValueError, KeyError, RuntimeError) as e:
        raise QkvError(
            f"optimizer state in {directory / OPTIM_FILE} does not fit this optimizer "
            f"({str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__})"
        ) from e
    # RNG last: everything that can fail has already been checked.
    restore_rng_state(part("rng."), state["rng"])
    gen_states = part("generator.")
    for name, g in generators.items():
        set_generator_state(g, gen_states[name])
    return model_state, state["extra"]


def _committed_file(directory: Path, name: str, sha256: str) -> Path:
    """The file holding the committed bytes of ``name``: itself, or its staged copy if a save died mid-move."""
    path = directory / name
    staged = staged_path(directory, name)
    if path.is_file() and file_sha256(path) == sha256:
        with contextlib.suppress(OSError):  # a leftover of an uncommitted (or already moved) save
            staged.unlink(missing_ok=True)
        return path
    if staged.is_file() and file_sha256(staged) == sha256:
        try:  # finish the interrupted save, so that `last.safetensors` is the latest weights again
            os.replace(staged, path)
        except OSError:
            return staged  # read-only directory: read the staged copy where it is
        _fsync_directory(directory)
        return path
    if not path.is_file():
        raise QkvError(f"checkpoint in {directory} is incomplete ({name} missing)")
    raise QkvError(
        f"checkpoint in {directory} is inconsistent ({name} does not match {STATE_FILE}; "
        "a save was probably interrupted)"
    )
