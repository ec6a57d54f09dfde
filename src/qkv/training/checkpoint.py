"""The training state of a run, crash-safe and pickle-free: what `--resume` needs to continue exactly.

    last.safetensors         the latest weights        ┐
    last_optim.safetensors   optimiser + RNG states    ├ written together
    last_state.json          step, counters, hashes    ┘ (the commit point)

Optimizer and RNG state, which PyTorch normally pickles, are split into a flat tensor dict
(safetensors) plus a small JSON-able dict (train_state.py).
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import Tensor
from torch.optim import Optimizer

from qkv.errors import QkvError
from qkv.io.files import (
    atomic_save_safetensors,
    atomic_write_json,
    file_sha256,
    fsync_directory,
    load_json,
    load_safetensors,
)
from qkv.io.run_dir import LAST_FILE, OPTIM_FILE, STATE_FILE
from qkv.training.train_state import (
    generator_state,
    optimizer_state_from_safetensors,
    optimizer_state_to_safetensors,
    restore_rng_state,
    rng_state_to_tensors,
    set_generator_state,
)

STATE_FORMAT = "qkv-training-state/1"


class StatefulOptimizer(Protocol):
    """What a checkpoint loads optimizer state into: a torch Optimizer, or an adapter that shards it."""

    def state_dict(self) -> dict[str, Any]:
        """The optimizer's state, keyed by parameter index."""

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore what state_dict returned."""


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
    staged = {name: staged_path(directory, name) for name in (LAST_FILE, OPTIM_FILE)}
    files: dict[str, dict[str, str]] = {}
    try:
        files[LAST_FILE] = {"sha256": atomic_save_safetensors(staged[LAST_FILE], model_state)}
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
    fsync_directory(directory)


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
    for name in (LAST_FILE, OPTIM_FILE):
        expected = state.get("files", {}).get(name, {}).get("sha256")
        if expected is None:
            raise QkvError(f"{directory / STATE_FILE} has no sha256 for {name}; re-save the checkpoint")
        sources[name] = _committed_file(directory, name, expected)
    model_state = load_safetensors(sources[LAST_FILE])
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
        fsync_directory(directory)
        return path
    if not path.is_file():
        raise QkvError(f"checkpoint in {directory} is incomplete ({name} missing)")
    raise QkvError(
        f"checkpoint in {directory} is inconsistent ({name} does not match {STATE_FILE}; "
        "a save was probably interrupted)"
    )
