"""Sharded, crash-safe training checkpoints with torch.distributed.checkpoint (DCP): what `--resume` needs.

    checkpoint/
        step-00000010/     one checkpoint: `.metadata` and one `__R_0.distcp` per rank, each rank writing its own
                           part of the weights and optimizer state; `state.json` and `rng.safetensors` from
                           rank 0 (step, counters, RNG and data-generator states)
        latest.json        names the committed step directory; written last, atomically

The commit rule: a checkpoint exists once latest.json names it. A process killed during a save leaves a step
directory that nothing names, `--resume` reads the previous one, and the next save removes the leftover.
DCP records each tensor's global shape and which piece each rank wrote, so a checkpoint written by N
processes under any strategy loads on M (resharded on reading).

Nothing read runs code: DCP stores only tensors here (the optimizer's hyperparameters go to state.json), which
it reads with torch.load(weights_only=True), and its `.metadata` (a pickle) is read by an unpickler that builds
DCP's own metadata classes and nothing else. The weights a user reads (generate, eval,
explore, convert) are the run's safetensors exports, written beside it (qkv.training.distributed.export_weights).
Runs from before this format (last_state.json, which lived four days) do not resume: their weights still load, and
a new run starts from them with --init-from.
"""

from __future__ import annotations

import json
import pickle
import shutil
import warnings
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn

from qkv.errors import QkvError
from qkv.io.files import atomic_save_safetensors, atomic_write_json, file_sha256, load_json, load_safetensors
from qkv.io.run_dir import CHECKPOINT_DIR, OPTIM_FILE, STATE_FILE
from qkv.training import distributed
from qkv.training.distributed import DistContext
from qkv.training.train_state import (
    from_jsonable,
    generator_state,
    restore_rng_state,
    rng_state_to_tensors,
    set_generator_state,
    to_jsonable,
)

# DCP warns on every single-process save and load, which is qkv's normal case, not a misconfiguration.
_SINGLE_PROCESS = "torch.distributed is disabled, unavailable or uninitialized"
warnings.filterwarnings("ignore", message=_SINGLE_PROCESS)  # also for a background save's thread

FORMAT = "qkv-checkpoint/2"
LATEST = "latest.json"


def has_checkpoint(run_dir: Path) -> bool:
    """True if the run directory holds a committed checkpoint (this format or the one before)."""
    return (Path(run_dir) / CHECKPOINT_DIR / LATEST).is_file() or (Path(run_dir) / STATE_FILE).is_file()


@dataclass
class PendingSave:
    """A save under way: its shards are being written (in the background if asynchronous); committed by wait()."""

    future: Future[Any] | None
    commit: Callable[[], None]

    def done(self) -> bool:
        """True once every shard is written (a background save has finished)."""
        return self.future is None or self.future.done()

    def wait(self) -> None:
        """Wait for the shards, then commit (rank 0 names the step directory in latest.json)."""
        if self.future is not None:
            self.future.result()
        self.commit()


def save_checkpoint(run_dir: Path, model: nn.Module, optimizer: torch.optim.Optimizer, extra: dict[str, Any],
                    generators: dict[str, torch.Generator], ctx: DistContext, *, frozen: bool,
                    asynchronous: bool = False) -> PendingSave:  # fmt: skip
    """Every rank writes its part of the weights and optimizer state; returns the save, to wait() for.

    frozen: leave out the weights that do not train (a LoRA run's base, which config.json names).
    asynchronous: stage the state in memory and write it in a background thread while training goes on.
    """
    step = int(extra["step"])
    name = f"step-{step:08d}"
    root = Path(run_dir) / CHECKPOINT_DIR
    if ctx.is_main:
        shutil.rmtree(root / name, ignore_errors=True)  # a save of this step that was never committed
        (root / name).mkdir(parents=True)
    state, groups = _state_dicts(model, optimizer, frozen)
    if ctx.is_main:
        _save_side_state(root / name, {"extra": extra, "param_groups": to_jsonable(groups, "optimizer groups")},
                         generators)  # fmt: skip
    distributed.agree(name, ctx)  # the directory and rank 0's files are there before any shard is written
    group = ctx.checkpoint_group if ctx.enabled else None
    if asynchronous:
        from torch.distributed.checkpoint import async_save

        future = cast(Future[Any], async_save(state, storage_writer=_writer(root / name), process_group=group,
                                              no_dist=not ctx.enabled))  # fmt: skip
    else:
        from torch.distributed.checkpoint import save

        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=_SINGLE_PROCESS)
            save(state, storage_writer=_writer(root / name), process_group=group, no_dist=not ctx.enabled)
        future = None

    def commit() -> None:
        """Name the new step directory in latest.json (the commit point), then remove every other one."""
        distributed.crash_for_test(f"save:{step}", ctx)
        if not ctx.is_main:
            return
        pointer = {"format": FORMAT, "step": step, "directory": name, "world_size": ctx.world_size,
                   "strategy": ctx.strategy}  # fmt: skip
        atomic_write_json(root / LATEST, pointer)
        for old in root.glob("step-*"):
            if old.name != name:
                shutil.rmtree(old, ignore_errors=True)
        for legacy in (STATE_FILE, OPTIM_FILE):  # a resumed older run: its resume state is superseded
            (Path(run_dir) / legacy).unlink(missing_ok=True)

    return PendingSave(future, commit)


def load_checkpoint(
    run_dir: Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    generators: dict[str, torch.Generator],
    ctx: DistContext,
    frozen: set[str],
) -> dict[str, Any]:
    """Restore the committed checkpoint into `model` and `optimizer` (resharded to this run's processes) and the
    RNG and generator states; returns the counters saved with it."""
    root = Path(run_dir) / CHECKPOINT_DIR
    if not (root / LATEST).is_file():
        if (Path(run_dir) / STATE_FILE).is_file():
            raise QkvError(f"{run_dir} keeps its resume state in {STATE_FILE}, the format of qkv before sharded "
                           "checkpoints, which no longer resumes; its weights still load, evaluate and generate: to "
                           f"train on, start a new run from them with --init-from {run_dir}")  # fmt: skip
        raise QkvError(f"no checkpoint to resume in {run_dir} ({CHECKPOINT_DIR}/{LATEST} missing): a run that "
                       "stopped before its first save starts again without --resume")  # fmt: skip
    pointer = load_json(root / LATEST, "checkpoint pointer")
    if pointer.get("format") != FORMAT:
        raise QkvError(f"{root / LATEST} has format {pointer.get('format')!r}, expected {FORMAT!r}")
    directory = root / str(pointer["directory"])
    if not (directory / ".metadata").is_file():
        raise QkvError(f"checkpoint {directory} named by {root / LATEST} is missing; the run directory is damaged")
    _verify(directory, ctx)
    side = load_json(directory / "state.json", "checkpoint state")
    missing = sorted(set(generators) - set(side["generators"]))
    if missing:
        raise QkvError(f"checkpoint {directory} has no state for generator(s) {', '.join(missing)}")
    state, _ = _state_dicts(model, optimizer, bool(frozen))
    from torch.distributed.checkpoint import load
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=_SINGLE_PROCESS)
            load(state, storage_reader=_reader(directory), no_dist=not ctx.enabled)
    except QkvError:
        raise
    except (Exception, CheckpointException) as e:  # DCP's exception holds every rank's: keep the first's message
        failures = list(getattr(e, "failures", {}).values())
        cause = failures[0] if failures else e
        cause = cause[0] if isinstance(cause, tuple) else getattr(cause, "exc", cause)  # (exception, its frames)
        if isinstance(cause, QkvError):
            raise cause from None
        text = str(cause).strip()
        first = f"{type(cause).__name__}: {text.splitlines()[0]}" if text else type(cause).__name__
        raise QkvError(f"checkpoint {directory} is damaged or does not fit this run's model or optimizer ({first})") \
            from None
    optim_sd = {"state": state["optimizer"], "param_groups": from_jsonable(side["param_groups"])}
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=cast(Any, optim_sd),
                   options=StateDictOptions(ignore_frozen_params=bool(frozen), strict=not frozen))  # fmt: skip
    tensors = load_safetensors(directory / "rng.safetensors")
    restore_rng_state({k[4:]: v for k, v in tensors.items() if k.startswith("rng.")}, side["rng"])
    for gen_name, g in generators.items():
        set_generator_state(g, tensors[f"generator.{gen_name}"])
    return cast(dict[str, Any], side["extra"])


def _state_dicts(model: nn.Module, optimizer: torch.optim.Optimizer, frozen: bool) -> tuple[dict[str, Any], Any]:
    """({"model": weights, "optimizer": its per-parameter state}, its param groups), keyed by parameter name and
    sharded as the model is (DTensors under FSDP): the tensors DCP writes, and the hyperparameters it does not."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    with warnings.catch_warnings():  # an optimizer without state yet is given it by a zero step, which warns
        warnings.simplefilter("ignore", UserWarning)
        model_sd, optim = get_state_dict(model, optimizer, options=StateDictOptions(ignore_frozen_params=frozen))
    optim_sd = cast(dict[str, Any], optim)
    for param, entries in optim_sd["state"].items():
        for key, value in entries.items():
            if not isinstance(value, torch.Tensor):
                raise QkvError(f"optimizer state {param}.{key} is a {type(value).__name__}; checkpoints hold tensors")
    return {"model": model_sd, "optimizer": optim_sd["state"]}, optim_sd["param_groups"]


def _save_side_state(directory: Path, side: dict[str, Any], generators: dict[str, torch.Generator]) -> None:
    """Rank 0's part: the counters and param groups (JSON), the RNG and generator states (safetensors)."""
    rng_tensors, rng_meta = rng_state_to_tensors()
    tensors = {f"rng.{k}": v for k, v in rng_tensors.items()}
    tensors.update({f"generator.{name}": generator_state(g) for name, g in generators.items()})
    try:
        json.dumps(side)
    except (TypeError, ValueError) as e:
        raise QkvError(f"cannot checkpoint extra training state: not JSON-serialisable ({e})") from e
    atomic_write_json(directory / "state.json", {**side, "rng": rng_meta, "generators": sorted(generators)})
    atomic_save_safetensors(directory / "rng.safetensors", tensors)


# What a DCP .metadata pickle may name: DCP's metadata classes, and torch's sizes, dtypes and layouts.
_DCP_METADATA = ("Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
                 "ChunkStorageMetadata", "BytesStorageMetadata", "_MEM_FORMAT_ENCODING")  # fmt: skip
_METADATA_CLASSES = {
    "torch.distributed.checkpoint.metadata": set(_DCP_METADATA),
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "pathlib": {"PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath"},
}


class _MetadataUnpickler(pickle.Unpickler):
    """Builds the classes of _METADATA_CLASSES and torch's Size and dtypes; refuses every other name."""

    def find_class(self, module: str, name: str) -> Any:
        if name in _METADATA_CLASSES.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and (name == "Size" or isinstance(getattr(torch, name, None), torch.dtype)):
            return getattr(torch, name)
        raise QkvError(f"checkpoint metadata names {module}.{name}, which a DCP checkpoint does not: refused")


def _writer(directory: Path) -> Any:
    """DCP's file writer, which also records the sha256 of every file it writes in checksums.json.

    Each rank hashes the files it wrote, as soon as they are written; the coordinator collects the digests with
    the rest of the save's results and writes them beside `.metadata`.
    """
    from torch.distributed.checkpoint import FileSystemWriter

    class Writer(FileSystemWriter):
        def write_data(self, plan: Any, planner: Any) -> Any:
            future = super().write_data(plan, planner)
            results = future.wait()
            written = {r.storage_data.relative_path for r in results}
            digests = {path: file_sha256(Path(directory) / path) for path in written}
            for r in results:
                r.storage_data.sha256 = digests[r.storage_data.relative_path]
            return future

        def finish(self, metadata: Any, results: Any) -> None:
            digests = {}
            for rank_results in results:
                for r in rank_results:
                    digests[r.storage_data.relative_path] = r.storage_data.__dict__.pop("sha256")
            super().finish(metadata, results)
            atomic_write_json(Path(directory) / "checksums.json", dict(sorted(digests.items())))

    return Writer(directory)


def _verify(directory: Path, ctx: DistContext) -> None:
    """Check the shard files against checksums.json, each rank hashing its share of them (file i: rank i mod N)."""
    digests = load_json(directory / "checksums.json", "checkpoint checksums")
    names = sorted(digests)[ctx.rank :: ctx.world_size]
    bad = [n for n in names if not (directory / n).is_file() or file_sha256(directory / n) != digests[n]]
    if distributed.any_rank(bool(bad), ctx):
        which = f" ({', '.join(bad)})" if bad else ""
        raise QkvError(f"checkpoint {directory} is damaged: a shard file does not match checksums.json{which}; "
                       "resume from a copy of the run or start a new one")  # fmt: skip


def _reader(directory: Path) -> Any:
    """DCP's file reader, reading `.metadata` with the allow-list unpickler instead of pickle.load."""
    from torch.distributed.checkpoint import FileSystemReader

    class Reader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            with open(Path(directory) / ".metadata", "rb") as f:
                metadata = _MetadataUnpickler(f).load()
            if getattr(metadata, "storage_meta", None) is not None:
                metadata.storage_meta.load_id = self.load_id
            return metadata

    return Reader(directory)
