"""An SAE opened for reading its features (`qkv interpret features`, the notebooks, the benchmarks), and the
activation cache a run can read instead of computing (`qkv interpret sae cache`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

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
    from qkv.sae import load_saelens
    from qkv.tasks import load

    where = Path(path)
    if (where / "cfg.json").is_file():
        if lm is None:
            raise QkvError(f"{where} is a SAELens SAE: give the model it reads with --lm MODEL")
        sae, metadata = load_saelens(where)
        cfg = dataclasses.replace(recipe(), lm=lm, source=data, hook=str(metadata.get("hook_name") or "") or None)
        if cfg.hook is None:
            raise QkvError(f"{where / 'cfg.json'} names no hook_name: qkv cannot tell where the SAE reads")
        if data is not None:
            base, hook, opened = load_subject(cfg, None)
        else:
            (base, hook), opened = load_hooked(lm, cfg.hook, role="--lm"), None
        if sae.cfg.d_model != width_of(base, hook):
            raise QkvError(f"{where} reads activations of width {sae.cfg.d_model}, and {hook} of {lm} has width "
                           f"{width_of(base, hook)}: the SAE belongs to another model")  # fmt: skip
        base.model.to(device)
        return SAEView(sae.to(device), base, hook, opened, min(128, base.model.cfg.context_length))
    if lm is not None or data is not None:
        raise QkvError(f"{where} is an SAE run, which records its model and data: drop --lm and --data")
    return view_of(load(where, checkpoint, "cpu", expect="sae"), device)


def view_of(run: SAERun, device: str | torch.device = "cpu") -> SAEView:
    """A loaded SAE run read for its features: its folded SAE, and its model (hash-checked), hook and data."""
    base, hook, opened = run.subject()
    base.model.to(device)
    norm = run.model.cfg.d_model**0.5 / float(run.model.input_scale)  # the scale took the mean norm to √d
    return SAEView(run.model.folded().to(device), base, hook, opened, run.config.block_size, norm,
                   filters_of(run.config, base))  # fmt: skip
