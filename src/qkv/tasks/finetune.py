"""Fine-tuning a pretrained checkpoint (`qkv train --init-from CHECKPOINT`): the language model's task, starting
from the checkpoint's weights, architecture and tokenizer instead of new ones.

Every weight trains, or (--lora-rank R) only LoRA adapters beside the frozen weights, which the loop adds from
outside the model. A LoRA run saves its adapters alone and names its base by path and sha256
(qkv.finetune.reference), so loading it back needs the very weights it was trained on.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar, TypeVar, cast

import torch

from qkv.finetune import Base, base_config, check_reference, load_base, load_lora_run, lora_of
from qkv.finetune.settings import check_architecture, check_data_tokenizer
from qkv.io.run_dir import read_run_config
from qkv.lora import LoRAConfig
from qkv.models import DecoderLM, DecoderLMConfig
from qkv.tasks.base import read_tokenizer
from qkv.tasks.lm import LMConfig, LMRun, LMTask
from qkv.tasks.lm import recipe as lm_recipe
from qkv.tokenizers import load_tokenizer
from qkv.training import RunConfig

# Fine-tuning never inherits the speedrun: AdamW at a small learning rate with a short warmup, short runs (each step
# of a 135M model takes seconds on a CPU), and a short sample.
SETTINGS = {"optim.name": "adamw", "optim.lr": 3e-5, "optim.weight_decay": 0.0, "optim.beta2": 0.999,
            "schedule.warmup_steps": 10, "schedule.max_steps": 100, "eval.interval": 50, "eval_tokens": 8192,
            "sample_tokens": 100}  # fmt: skip
LORA_LR = 2e-4  # LoRA's adapters take a larger rate than full fine-tuning (the LoRA paper, PEFT's and litgpt's recipes)


def recipe(base: LMConfig, init_from: str, lora: LoRAConfig | None) -> LMConfig:
    """A language model's recipe made a fine-tuning one: the checkpoint's model, never the speedrun's, and SETTINGS
    (LoRA's learning rate with adapters)."""
    tuned = base.override({**SETTINGS, "init_from": init_from, **({"optim.lr": LORA_LR} if lora else {})})
    return dataclasses.replace(tuned, model=base_config(init_from), lora=lora)


C = TypeVar("C", bound=LMConfig)


def recipe_as(cls: type[C]) -> C:
    """The language model's recipe as a config of `cls`: a post-training task's, whose settings extend it."""
    lm = lm_recipe()
    return cls(**{f.name: getattr(lm, f.name) for f in dataclasses.fields(lm)})


def post_training(cfg: C, settings: Mapping[str, Any], lora_lr: float) -> C:
    """A fine-tuning recipe made a post-training one: its settings (lora_lr with adapters), and whole examples up to
    the checkpoint's context."""
    lr = lora_lr if cfg.lora is not None else settings["optim.lr"]
    return dataclasses.replace(cfg.override({**settings, "optim.lr": lr}), block_size=None)


class FinetuneTask(LMTask):
    """Next-token prediction on text, from a checkpoint (LoRA adapters beside it, if asked)."""

    def __init__(self, cfg: LMConfig) -> None:
        super().__init__(cfg)
        self.base: Base | None = None  # the checkpoint, loaded (a resumed full fine-tune needs only its tokenizer)
        self.stored_base: dict[str, Any] | None = None  # a resumed run's record of it

    @classmethod
    def run_name(cls, cfg: RunConfig[Any]) -> str:
        """<data name>-<checkpoint name>[-lora], e.g. shakespeare-SmolLM2-135M-Instruct.Q4_1-lora."""
        assert isinstance(cfg, LMConfig) and cfg.init_from is not None
        return f"{cfg.text_name()}-{Path(cfg.init_from).stem}{'-lora' if cfg.lora is not None else ''}"

    def setup(self, run_dir: Path, resume: bool) -> None:
        """Load the checkpoint (on resume too, for a LoRA run: only its adapters were saved), then its data, whose
        tokenizer must be the checkpoint's."""
        cfg = self.cfg
        assert cfg.init_from is not None
        self.load_base(run_dir, resume)
        stored = load_tokenizer(run_dir) if resume else None
        assert self.base is not None or stored is not None
        new = self.base.tokenizer if self.base is not None else stored
        if self.base is not None and not resume and cfg.data_dir:
            check_data_tokenizer(str(cfg.source), self.base.tokenizer, cfg.init_from)
        assert new is not None
        self.open_data(run_dir if resume else None, stored, new, Path(cfg.init_from).name)

    def load_base(self, run_dir: Path, resume: bool) -> None:
        """The checkpoint --init-from names; on resume, the very weights the run was trained on (hash-checked)."""
        assert self.cfg.init_from is not None
        reference = self.stored_base = read_run_config(run_dir).get("base") if resume else None
        if resume and self.cfg.lora is None:
            return  # the run's own checkpoint holds every weight
        if reference is not None:
            check_reference(reference, run_dir)
        self.base = load_base(self.cfg.init_from, reference)

    def model_config(self) -> DecoderLMConfig:
        """The checkpoint's model, with only its dropouts changeable."""
        cfg = super().model_config()
        if self.base is not None:
            check_architecture(self.base.model.cfg, cfg)
        return cfg

    def build_model(self) -> torch.nn.Module:
        """The checkpoint's model (rebuilt with the run's dropouts where they differ), in training mode."""
        if self.base is None:
            return super().build_model()
        cfg, model = self.model_config(), self.base.model
        if cfg != model.cfg:
            model = DecoderLM(cfg)
            model.load_state_dict(self.base.model.state_dict())
        return model.train()

    def lora_config(self) -> LoRAConfig | None:
        """The run's adapters, if any."""
        return self.cfg.lora

    def base_summary(self) -> dict[str, Any] | None:
        """The checkpoint a fine-tuning run started from: path, sha256 of its weights, kind, metadata."""
        return self.base.reference if self.base is not None else self.stored_base

    def loaded(self, run_dir: Path) -> LMRun:
        """The run, loaded back (a LoRA run's base with its adapters merged)."""
        return FinetunedRun.load(run_dir)


class FinetunedRun(LMRun):
    """A fine-tuned language model; a LoRA run loads its base (hash-checked) with its adapters, merged."""

    config_class: ClassVar[type[RunConfig[Any]]] = LMConfig

    @classmethod
    def load(cls, directory: Path, checkpoint: str = "best", device: str | torch.device = "cpu",
             stored: dict[str, Any] | None = None) -> FinetunedRun:  # fmt: skip
        """A run directory's model: its own weights, or its base with its adapters."""
        stored = read_run_config(directory) if stored is None else stored
        if lora_of(stored["training"]) is None:
            return super().load(directory, checkpoint, device, stored)
        model = load_lora_run(directory, stored, checkpoint)
        config = cast(LMConfig, cls.config_class.from_stored(stored))
        return cls(model.to(device), read_tokenizer(Path(directory)), config, Path(directory), checkpoint)
