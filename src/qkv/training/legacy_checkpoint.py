"""Resuming runs written before sharded checkpoints (qkv.training.checkpoint), which kept three files:

    last.safetensors         the latest weights        ┐
    last_optim.safetensors   optimiser + RNG states    ├ written together
    last_state.json          step, counters, hashes    ┘ (the commit point)

Read only: a resumed run's next checkpoint is a sharded one, and these files are then removed (the
weights stay as last.safetensors, the run's export). Optimizer and RNG state, which PyTorch normally
pickles, were split into a flat tensor dict (safetensors) plus a small JSON-able dict (train_state.py).
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any, Protocol, cast

import torch
from torch import Tensor, nn

from qkv.errors import QkvError
from qkv.io.files import (
    file_sha256,
    fsync_directory,
    load_json,
    load_safetensors,
)
from qkv.io.run_dir import LAST_FILE, OPTIM_FILE, STATE_FILE, check_weights
from qkv.training.distributed import DistContext
from qkv.training.train_state import (
    optimizer_state_from_safetensors,
    restore_rng_state,
    set_generator_state,
)

STATE_FORMAT = "qkv-training-state/1"


def load_legacy(
    directory: Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    generators: dict[str, torch.Generator],
    ctx: DistContext,
    frozen: set[str],
) -> dict[str, Any]:
    """Resume from the three files: weights into `model`, optimizer, RNG and generators in place; returns extra."""
    consolidated = _ConsolidatedOptimizer(model, optimizer, ctx)
    state, extra = load_training_state(directory, consolidated, generators)
    if frozen:  # a LoRA run's checkpoint holds what trains; its frozen weights are its base's, already loaded
        state = {**{k: v for k, v in model.state_dict().items() if k in frozen}, **state}
    check_weights(model, state, Path(directory) / LAST_FILE)
    if ctx.sharded:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        set_model_state_dict(model, cast(Any, state), options=StateDictOptions(full_state_dict=True))
    else:
        model.load_state_dict(state)
    return extra


class StatefulOptimizer(Protocol):
    """What a checkpoint loads optimizer state into: a torch Optimizer, or an adapter that shards it."""

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore what state_dict returned."""


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


def staged_path(directory: Path, name: str) -> Path:
    """Where the old writer put ``name`` before its checkpoint was committed."""
    return Path(directory) / f".{name}.next"


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


class _ConsolidatedOptimizer:
    """An optimizer that loads a consolidated, index-keyed state dict; under FSDP each rank keeps its shard."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, ctx: DistContext) -> None:
        self.model, self.optimizer, self.ctx = model, optimizer, ctx

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a consolidated, index-keyed state; under FSDP every rank keeps its own shard of it."""
        if not self.ctx.sharded:
            self.optimizer.load_state_dict(state_dict)
            return
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        ids = {id(p): name for name, p in self.model.named_parameters()}
        names = [ids[id(p)] for group in self.optimizer.param_groups for p in group["params"]]
        if len(state_dict["param_groups"]) != len(self.optimizer.param_groups):
            raise ValueError("the checkpoint's optimizer has a different number of parameter groups")
        by_name = {
            "state": {names[int(i)]: s for i, s in state_dict["state"].items()},
            "param_groups": [{**g, "params": [names[int(i)] for i in g["params"]]} for g in state_dict["param_groups"]],
        }
        options = StateDictOptions(full_state_dict=True)
        set_optimizer_state_dict(self.model, self.optimizer, cast(Any, by_name), options=options)
