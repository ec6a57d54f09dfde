"""RunConfig: the settings every training task shares, defined and validated once.

A task's config (qkv.tasks: LMConfig, TranslateConfig, MLMConfig, CopyConfig, …) subclasses it, adds
its own fields and may give a shared field its own default (the translation task keeps β₂ 0.98, …).
Each field carries its help text (`option`), so one field appears in the command line
(`qkv train TASK --help`), in config.json and in the Python API together.

A config remembers which settings it was given (`given`): resuming a run keeps the stored settings
except those, even where a given value equals the default.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from qkv.config import BlockConfig
from qkv.errors import QkvError
from qkv.io.devices import DTYPES
from qkv.training.schedule import SCHEDULE_KINDS

OPTIMIZERS = ("adamw", "muon")  # qkv.training.optim
STRATEGIES = ("ddp", "fsdp")  # how several processes (torchrun, --nproc) share the work


def option(
    default: Any = dataclasses.MISSING,
    help: str = "",
    *,
    fixed: bool = False,
    choices: tuple[str, ...] | None = None,
    factory: Any = dataclasses.MISSING,
) -> Any:
    """A config field with its help text; fixed: what a run trains, which a resumed run may not change."""
    metadata = {"help": help, "fixed": fixed, "choices": choices}
    return field(default=default, default_factory=factory, metadata=metadata)


def dashed(name: str) -> str:
    """A field's name as its command-line option: max_steps → max-steps."""
    return name.replace("_", "-")


@dataclass(kw_only=True)
class RunConfig:
    """How to train: batch, optimiser, schedule, budget, evaluation, device, processes, output."""

    task: ClassVar[str] = ""  # the task's name in qkv.tasks' registry
    model_config: ClassVar[type[BlockConfig]] = BlockConfig  # the model config `model` holds fields of
    default_model: ClassVar[dict[str, Any]] = {}  # the task's model recipe, under the given `model` fields
    newton_schulz_steps: ClassVar[int] = 5  # the recipe's orthogonalisation iterations per Muon step

    model: dict[str, Any] = option(factory=dict, help="model-config fields over the task's recipe", fixed=True)
    batch_size: int = option(8, "sequences per micro-batch and process", fixed=True)
    grad_accum: int = option(1, "micro-batches per optimiser step", fixed=True)
    max_steps: int = option(600, "optimiser steps (the schedule's length)")
    max_time: float | None = option(None, "stop after this many seconds, evaluations included (none: no limit)")
    lr: float = option(3e-3, "peak learning rate")
    min_lr: float | None = option(None, "final learning rate (none: lr / 20)")
    warmup_steps: int = option(100, "linear warmup steps")
    schedule: str = option("cosine", "the decay after warmup", choices=SCHEDULE_KINDS)
    optimizer: str = option("adamw", "adamw, or muon: Muon for the blocks' matrices, AdamW for the rest", fixed=True,
                            choices=OPTIMIZERS)  # fmt: skip
    weight_decay: float = option(0.1, "AdamW weight decay on matrices")
    beta1: float = option(0.9, "AdamW β₁")
    beta2: float = option(0.99, "AdamW β₂")
    grad_clip: float = option(1.0, "max gradient norm (0 = no clipping)")
    fused_optimizer: bool = option(True, "PyTorch's fused AdamW kernel (off: its multi-tensor implementation)")
    eval_interval: int = option(300, "steps between evaluations and checkpoints")
    device: str = option("auto", "auto, cpu, cuda, cuda:N or mps")
    dtype: str = option("auto", "autocast dtype, weights stay float32 (auto: bfloat16 with TF32 matmuls on CUDA, "
                        "float32 elsewhere; float32: full precision everywhere)",
                        choices=("auto", *DTYPES))  # fmt: skip
    compile: bool = option(False, "torch.compile each Transformer layer (whole graphs only: a graph break is an "
                           "error); works with ddp and fsdp")  # fmt: skip
    activation_checkpointing: bool = option(False, "recompute each layer's activations in the backward pass instead "
                                            "of keeping them: less memory, one more forward per layer")  # fmt: skip
    cpu_threads: int | None = option(None, "intra-op CPU threads (none: one per core)")
    strategy: str = option("ddp", "with several processes: ddp, or fsdp (sharded parameters)", choices=STRATEGIES)
    dist_timeout: float = option(1800.0, "seconds a collective waits for a slow, dead or hung process (a rank "
                                 "waits at a checkpoint while the others write theirs)")  # fmt: skip
    async_checkpoint: bool = option(False, "write checkpoints in a background thread while training goes on (the "
                                    "state is first copied to memory; committed when written)")  # fmt: skip
    seed: int = option(1337, "random seed (weights, batches, dropout)", fixed=True)
    out_dir: str | None = option(None, "run directory (none: runs/<task name>-<date>-<time>)")
    resume: bool = option(False, "continue the run in --out-dir")

    def __new__(cls, *args: Any, **kwargs: Any) -> RunConfig:
        """Remember which settings were given, before the dataclass __init__ sets every field."""
        self = super().__new__(cls)
        object.__setattr__(self, "_given", frozenset(kwargs))
        return self

    def __post_init__(self) -> None:
        """Refuse impossible settings with a message naming the setting."""
        for f in dataclasses.fields(self):
            choices, value = f.metadata.get("choices"), getattr(self, f.name)
            if choices and value not in choices and not (value is None and f.default is None):
                raise QkvError(f"unknown {f.name} {getattr(self, f.name)!r}; choose one of: {', '.join(choices)}")
        for name in ("batch_size", "grad_accum", "max_steps", "eval_interval"):
            positive_int(self, name)
        if self.cpu_threads is not None:
            positive_int(self, "cpu_threads")
        if not isinstance(self.warmup_steps, int) or self.warmup_steps < 0:
            raise QkvError(f"warmup-steps must be ≥ 0, got {self.warmup_steps}")
        if self.lr <= 0:
            raise QkvError(f"lr must be positive, got {self.lr}")
        if self.max_time is not None and self.max_time <= 0:
            raise QkvError(f"max-time must be positive seconds, got {self.max_time}")
        if self.dist_timeout <= 0:
            raise QkvError(f"dist-timeout must be positive seconds, got {self.dist_timeout}")
        if self.grad_clip < 0 or self.weight_decay < 0:
            raise QkvError("grad-clip and weight-decay must be ≥ 0")
        if not (0 <= self.beta1 < 1 and 0 <= self.beta2 < 1):
            raise QkvError(f"betas must be in [0, 1), got ({self.beta1}, {self.beta2})")
        self._check_model()
        if not self.resume:  # a resumed run's settings are checked together once merged with the stored ones
            self.check_together()

    def check_together(self) -> None:
        """The rules that tie settings to each other (run on the whole, merged config of a resumed run too)."""
        if self.min_lr is not None and not 0 <= self.min_lr <= self.lr:
            raise QkvError(f"min-lr must be in [0, lr={self.lr}], got {self.min_lr}")

    def _check_model(self) -> None:
        """Lay the given model fields over the task's recipe, refusing names its model config does not have."""
        if not isinstance(self.model, dict):
            raise QkvError(f"model must be a dict of {self.model_config.__name__} fields, got {type(self.model)}")
        recipe = self.recipe()
        if self.model.get("attention") == "mla":  # every head reads MLA's one latent: no key/value heads to set
            recipe.pop("n_kv_heads", None)
        self.model = {**recipe, **self.model}
        unknown = sorted(set(self.model) - {f.name for f in dataclasses.fields(self.model_config)})
        if unknown:
            names = ", ".join(map(str, unknown))
            raise QkvError(f"unknown model field(s): {names}; see {self.model_config.__name__} for the fields")

    def recipe(self) -> dict[str, Any]:
        """The model fields the task's recipe sets under the given ones (a fine-tuning run takes its checkpoint's)."""
        return dict(self.default_model)

    @property
    def given(self) -> frozenset[str]:
        """The settings this config was given explicitly (the others hold defaults)."""
        return self.__dict__.get("_given", frozenset())

    @property
    def final_lr(self) -> float:
        """The learning rate at the end of the schedule."""
        return self.lr / 20 if self.min_lr is None else self.min_lr

    def build_model_config(self, **task_fields: Any) -> Any:
        """The model config: the task's own fields (vocabulary, …) plus `model`, with one-line errors."""
        try:
            return self.model_config(**{**task_fields, **self.model})
        except TypeError as e:  # a value of the wrong type, e.g. --model dropout=abc
            raise QkvError(f"invalid model setting in {self.model}: {e}") from None

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict of every setting."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RunConfig:
        """Build from config.json's "training" entry, refusing unknown keys by name."""
        unknown = sorted(set(data) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise QkvError(f"unknown {cls.task or 'training'} setting(s): {', '.join(unknown)}")
        return cls(**data)

    def resumed_from(self, stored: dict[str, Any]) -> RunConfig:
        """The stored run's settings with the ones given here laid over them; what the run trains may not change."""
        kept = type(self).from_dict(stored)
        changes: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            if f.name not in self.given or f.name in ("resume", "out_dir"):
                continue
            new, old = getattr(self, f.name), getattr(kept, f.name)
            if f.metadata.get("fixed") and new != old:
                flag = "--model" if f.name == "model" else f"--{dashed(f.name)}"
                raise QkvError(f"{flag} cannot change on --resume (the run has {f.name}={old!r}); drop it")
            changes[f.name] = new
        merged = type(self)(**{**stored, **changes, "resume": True, "out_dir": self.out_dir})
        merged.check_together()
        return merged


def absolute(path: str | None) -> str | None:
    """A data file's absolute path, so that eval and resume find it from any directory (None stays None)."""
    return None if path is None else str(Path(path).expanduser().resolve())


def positive_int(cfg: RunConfig, name: str) -> None:
    """Refuse a setting that is not a positive integer, naming it as the command line does."""
    value = getattr(cfg, name)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise QkvError(f"{dashed(name)} must be a positive integer, got {value!r}")
