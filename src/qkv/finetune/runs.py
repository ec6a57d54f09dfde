"""qkv directories as bases and LoRA runs loaded back: the base (hash-checked), then its adapters, merged."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch import Tensor, nn

from qkv.blocks.lora import LoRASpec, add_lora, merge_lora
from qkv.errors import QkvError
from qkv.io.files import load_safetensors
from qkv.io.run_dir import BEST_FILE, CHECKPOINTS, LAST_FILE, check_weights, read_run_config
from qkv.models import DecoderLM, QkvModel, config_from_dict


def lora_spec_of(training: dict[str, Any]) -> LoRASpec | None:
    """The LoRA settings of a run config's "training" entry (None: a run without adapters)."""
    if training.get("lora_rank") is None:
        return None
    targets = tuple(t.strip() for t in str(training["lora_targets"]).split(",") if t.strip())
    return LoRASpec(training["lora_rank"], float(training["lora_alpha"]), float(training["lora_dropout"]), targets)


def complete_state(model: nn.Module, saved: dict[str, Tensor], source: Path) -> dict[str, Tensor]:
    """A run's saved tensors (its adapters) with the model's frozen ones around them, checked as a whole."""
    state = {**model.state_dict(), **saved}
    check_weights(model, state, source)
    return state


def load_lora_run(directory: str | Path, stored: dict[str, Any] | None = None, checkpoint: str = "best",
                  merge: bool = True) -> DecoderLM:  # fmt: skip
    """A LoRA run's model: its base (refused if its weights changed), its adapters, merged unless merge=False."""
    from qkv.finetune.base import check_reference, load_base

    directory = Path(directory)
    stored = read_run_config(directory) if stored is None else stored
    spec = lora_spec_of(stored["training"])
    if spec is None or "base" not in stored:
        raise QkvError(f"{directory} is not a LoRA run (its config.json has no lora_rank and base)")
    check_reference(stored["base"], directory)
    base = load_base(stored["base"]["path"], stored["base"])
    model = base.model
    cfg = config_from_dict(stored["model_type"], stored["model"])
    if cfg != model.cfg:  # e.g. dropout given for fine-tuning: the same weights in the run's own model
        rebuilt = DecoderLM(cfg)  # type: ignore[arg-type]
        rebuilt.load_state_dict(model.state_dict())
        model = rebuilt
    add_lora(model, spec)
    if checkpoint not in CHECKPOINTS:
        raise QkvError(f"checkpoint must be 'best' or 'last', got {checkpoint!r}")
    weights = directory / (BEST_FILE if checkpoint == "best" else LAST_FILE)
    if not weights.is_file():
        raise QkvError(f"{directory} has no {weights.name} yet (training has not reached its first evaluation)")
    model.load_state_dict(complete_state(model, load_safetensors(weights), weights))
    return (merge_lora(model) if merge else model).eval()  # type: ignore[return-value]


def load_lm_dir(directory: str | Path) -> QkvModel:
    """A qkv directory's model: a `qkv convert` directory or a run, a LoRA run merged onto its base."""
    from qkv.finetune.base import is_lora_run
    from qkv.interop.qkv_dir import load_qkv

    return load_lora_run(directory) if is_lora_run(directory) else load_qkv(directory)
