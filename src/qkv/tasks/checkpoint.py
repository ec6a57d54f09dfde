"""Models that are not runs of `qkv train`: a .gguf file, a Hugging Face directory or a `qkv convert` directory,
loaded as a run of the task their model fits, so that every command that reads a model takes all of them."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from qkv.errors import QkvError
from qkv.io.files import load_json
from qkv.io.run_dir import CONFIG_FILE, FORMATS, migrate_config
from qkv.tasks.finetune import FinetunedRun
from qkv.tasks.lm import LMConfig, recipe


def run_task(path: Path) -> str | None:
    """The task of the `qkv train` run at `path`, in any layout qkv reads (None: not a run). A config.json that is
    not JSON is refused as it is: the directory is damaged, whatever it held."""
    if not (path.is_dir() and (path / CONFIG_FILE).is_file()):
        return None
    stored = load_json(path / CONFIG_FILE)
    if stored.get("format") not in FORMATS or "training" not in stored or "model" not in stored:
        return None
    return str(migrate_config(stored)["task"])


def model_task(path: Path, role: str = "MODEL") -> str:
    """The task of the run at `path`, or lm for a checkpoint of a language model (its config read, not its weights);
    a one-line error for anything else."""
    from qkv.finetune.base import base_config

    task = run_task(path)
    if task is None:
        base_config(path, role)
        task = "lm"
    return task


@dataclass
class CheckpointRun(FinetunedRun):
    """A language model read from a checkpoint file or directory, as a run of `qkv train lm` would be loaded."""

    metadata: dict[str, Any] = field(default_factory=dict)  # the checkpoint's special ids and chat template

    @classmethod
    def of(cls, path: Path, device: str | torch.device, role: str, native: bool = False) -> CheckpointRun:
        """The decoder-only model and tokenizer at `path`, or a one-line error saying what it holds instead."""
        from qkv.finetune.base import load_base

        base = load_base(path, role=role, native=native)
        config = recipe().override({"model": base.model.cfg, "block_size": min(1024, base.model.cfg.context_length)})
        assert isinstance(config, LMConfig)
        metadata = dict(base.reference.get("metadata") or {})
        return cls(base.model.to(device).eval().requires_grad_(False), base.tokenizer, config, path, path.suffix[1:]
                   or "weights", metadata)  # fmt: skip

    def evaluate(self, options: Any) -> list[str]:
        """A checkpoint has no held-out split of its own: say what measures it."""
        raise QkvError(f"{self.directory} is a checkpoint, not a run with a validation split: measure it with "
                       f"`qkv eval {self.directory} --bpb` (bits per byte) or --bench NAMES")  # fmt: skip


def load_checkpoint(path: Path, device: str | torch.device, refused: str | None, role: str,
                    native: bool = False) -> CheckpointRun:  # fmt: skip
    """The language model in a checkpoint that is not a run; refused: what the command needs instead, if it needs
    something else (e.g. "translation model; give a run of `qkv train translate`")."""
    from qkv.finetune.base import base_config

    base_config(path, role)  # refuses what is no checkpoint, or holds no decoder-only model, in one line
    if refused is not None:
        raise QkvError(f"{path} holds a language model, not a {refused}")
    return CheckpointRun.of(path, device, role, native)
