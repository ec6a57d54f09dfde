"""An SAE opened for reading its features (`qkv interpret features`, the notebooks, the benchmarks), and the
activation cache a run can read instead of computing (`qkv interpret sae cache`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import torch

from qkv.data.tokens import TokenData
from qkv.errors import QkvError
from qkv.finetune.base import Base
from qkv.io.devices import matmul_precision, resolve_device, resolve_dtype
from qkv.sae import SparseAutoencoder
from qkv.sae.activations import ActivationStream, Filters
from qkv.sae.cache import write_cache
from qkv.tasks.sae import SAERun, SAETrainConfig, cache_about, filters_of, load_hooked, load_subject, recipe, width_of


def cache_activations(cfg: SAETrainConfig, tokens: int, out: str | Path) -> Path:
    """Write the first `tokens` activations of the stream a run of `cfg` trains on (its seed's) into `out`, with
    progress; a later run with --activations OUT reads them instead of computing them."""
    from qkv.io.progress import ProgressLine, batch_progress

    base, hook, data = load_subject(cfg, None, resolve_device(cfg.system.device))
    filters = filters_of(cfg, base)
    stream = ActivationStream(base.model, hook, data.split("train"), cfg.block_size, filters, cfg.buffer_tokens,
                              cfg.system.seed)  # fmt: skip
    line = ProgressLine()
    show = batch_progress(line, f"caching {tokens:,} activations of {hook}", after_s=0.0)
    device = next(base.model.parameters()).device
    with matmul_precision(device, resolve_dtype(cfg.system.dtype, device)):  # as a training run computes them
        where = write_cache(stream, tokens, out, {**cache_about(cfg, base, hook, data), "block_size": cfg.block_size},
                            show)  # fmt: skip
    line.close_if_drawn()
    return where


@dataclass
class SAEView:
    """An SAE ready to read features with: its folded form, the model and hook it reads, its tokenizer, and the
    data its contexts come from (None for a SAELens directory given without --data)."""

    sae: SparseAutoencoder
    base: Base
    hook: str
    data: TokenData | None
    block_size: int = 128
    norm: float | None = None  # the activations' mean norm at the hook (a qkv run measured it; SAELens's: unknown)
    filters: Filters = field(default_factory=Filters)  # the positions its training left out (a run's own)


def open_sae(path: str | Path, lm: str | None = None, data: str | None = None, checkpoint: str = "best",
             device: str | torch.device = "cpu") -> SAEView:  # fmt: skip
    """A qkv SAE run (its model and data as recorded, the model hash-checked), or a SAELens directory read with the
    model `lm` (its hook_name must be one of the model's hooks) and optionally a data directory."""
    from qkv.tasks import load

    where = Path(path)
    if is_saelens(where):
        if lm is None:
            raise QkvError(f"{where} is a SAELens SAE: give the model it reads with --lm MODEL")
        return view_of(saelens_run(where, lm, data), device)
    if lm is not None or data is not None:
        raise QkvError(f"{where} is an SAE run, which records its model and data: drop --lm and --data")
    return view_of(load(where, checkpoint, "cpu", expect="sae"), device)


def is_saelens(path: Path) -> bool:
    """Whether `path` holds an SAE in SAELens's format (cfg.json; its weights are checked when it is read)."""
    return (path / "cfg.json").is_file()


@dataclass
class SAELensRun:
    """A SAELens directory opened as a run is (the explorer opens it so): its SAE, its metadata, and the model and
    data given with it, since SAELens's format records neither."""

    directory: Path
    model: SparseAutoencoder
    metadata: dict[str, Any]
    lm: str
    data: str | None
    task: ClassVar[str] = "sae"
    checkpoint: ClassVar[str] = "saelens"


def saelens_run(path: Path, lm: str, data: str | None = None) -> SAELensRun:
    """The SAELens SAE at `path`, to be read on the model `lm` (and the data directory `data`)."""
    from qkv.sae import load_saelens

    sae, metadata = load_saelens(path)
    return SAELensRun(path, sae, metadata, lm, data)


def _saelens_view(run: SAELensRun, device: str | torch.device) -> SAEView:
    """A SAELens run's view: the model given and the hook its cfg.json names, checked to fit the SAE."""
    hook = str(run.metadata.get("hook_name") or "") or None
    if hook is None:
        raise QkvError(f"{run.directory / 'cfg.json'} names no hook_name: qkv cannot tell where the SAE reads")
    saved = (run.metadata.get("qkv") or {}).get("filters") or {}  # a qkv export's own; else qkv's defaults
    cfg = dataclasses.replace(recipe(), lm=run.lm, source=run.data, hook=hook, **{k: v for k, v in saved.items()
                              if k in ("drop_first", "max_norm_ratio")})  # fmt: skip
    if run.data is not None:
        base, hook, opened = load_subject(cfg, None)
    else:
        (base, hook), opened = load_hooked(run.lm, hook, role="--lm"), None
    if run.model.cfg.d_model != width_of(base, hook):
        raise QkvError(f"{run.directory} reads activations of width {run.model.cfg.d_model}, and {hook} of {run.lm} "
                       f"has width {width_of(base, hook)}: the SAE belongs to another model")  # fmt: skip
    base.model.to(device)
    return SAEView(run.model.to(device), base, hook, opened, min(128, base.model.cfg.context_length),
                   filters=filters_of(cfg, base))  # fmt: skip


def view_of(run: SAERun | SAELensRun, device: str | torch.device = "cpu") -> SAEView:
    """A loaded SAE run read for its features: its folded SAE, and its model (hash-checked), hook and data."""
    if isinstance(run, SAELensRun):
        return _saelens_view(run, device)
    base, hook, opened = run.subject()
    base.model.to(device)
    norm = run.model.cfg.d_model**0.5 / float(run.model.input_scale)  # the scale took the mean norm to √d
    return SAEView(run.model.folded().to(device), base, hook, opened, run.config.block_size, norm,
                   filters_of(run.config, base))  # fmt: skip
