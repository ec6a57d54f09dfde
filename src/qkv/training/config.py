"""RunConfig: how a run trains, in sections (optimiser, schedule, evaluation, data, system, checkpointing) beside
its model config; a task's config adds the settings of its own.

Every setting is declared once, with its help text (`option`), and has one command-line flag: its name, or the
flag its declaration gives (optim.name is --optimizer, lora.rank is --lora-rank). The flags are what
`qkv train TASK` offers and what `override` takes besides dotted paths. A task's defaults come from its recipe
(a function returning its whole config, qkv.tasks), never from fields declared again.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Generic, Literal, TypeVar

from qkv.config import Config, option, positive
from qkv.errors import QkvError
from qkv.models import ModelConfig

M = TypeVar("M", bound=ModelConfig)
R = TypeVar("R", bound="RunConfig[Any]")

Optimizer = Literal["adamw", "muon"]  # qkv.training.optim
Schedule = Literal["cosine", "linear", "constant", "inverse_sqrt"]  # qkv.training.schedule
Strategy = Literal["ddp", "fsdp"]  # how several processes (torchrun, --nproc) share the work
STRATEGIES: tuple[str, ...] = typing.get_args(Strategy)
Dtype = Literal["auto", "float32", "bfloat16", "float16"]


@dataclass(frozen=True, kw_only=True)
class OptimConfig(Config):
    """The optimiser."""

    named_errors: ClassVar[bool] = False  # its messages name the flags

    name: Optimizer = option("adamw", "adamw, or muon: Muon for the blocks' matrices, AdamW for the rest",
                             fixed=True, flag="optimizer")  # fmt: skip
    lr: float = option(3e-3, "peak learning rate")
    weight_decay: float = option(0.1, "AdamW weight decay on matrices")
    beta1: float = option(0.9, "AdamW β₁")
    beta2: float = option(0.99, "AdamW β₂")
    grad_clip: float = option(1.0, "max gradient norm (0 = no clipping)")
    fused: bool = option(True, "PyTorch's fused AdamW kernel (off: its multi-tensor implementation)",
                         flag="fused_optimizer")  # fmt: skip
    newton_schulz_steps: int = option(5, "Muon: Newton–Schulz iterations that orthogonalise each update")

    def check(self) -> None:
        """Positive rates, betas in [0, 1)."""
        if self.lr <= 0:
            raise QkvError(f"lr must be positive, got {self.lr}")
        if self.grad_clip < 0 or self.weight_decay < 0:
            raise QkvError("grad-clip and weight-decay must be ≥ 0")
        if not (0 <= self.beta1 < 1 and 0 <= self.beta2 < 1):
            raise QkvError(f"betas must be in [0, 1), got ({self.beta1}, {self.beta2})")
        positive(self, "newton_schulz_steps")


@dataclass(frozen=True, kw_only=True)
class ScheduleConfig(Config):
    """The learning rate over the run, and its length."""

    named_errors: ClassVar[bool] = False  # its messages name the flags

    decay: Schedule = option("cosine", "the decay after warmup", flag="schedule")
    warmup_steps: int = option(100, "linear warmup steps")
    max_steps: int = option(600, "optimiser steps (the schedule's length)")
    min_lr: float | None = option(None, "final learning rate (none: lr / 20)")
    max_time: float | None = option(None, "stop after this many seconds, evaluations included (none: no limit)")

    def check(self) -> None:
        """A positive length and time budget, a warmup ≥ 0."""
        if self.max_steps < 1:
            raise QkvError(f"max-steps must be a positive integer, got {self.max_steps!r}")
        if self.warmup_steps < 0:
            raise QkvError(f"warmup-steps must be ≥ 0, got {self.warmup_steps}")
        if self.max_time is not None and self.max_time <= 0:
            raise QkvError(f"max-time must be positive seconds, got {self.max_time}")

    def warm_up_note(self, lr: float) -> str | None:
        """A note for a run whose every step is warm-up (the rate climbs to lr at the last step, never decays)."""
        if self.max_steps > self.warmup_steps:
            return None
        return (f"note: every step is warm-up (--warmup-steps {self.warmup_steps} ≥ --max-steps {self.max_steps}): the "
                f"learning rate climbs to --lr {lr:g} over the whole run and never decays; lower --warmup-steps or "
                "raise --max-steps")  # fmt: skip


@dataclass(frozen=True, kw_only=True)
class DataConfig(Config):
    """How much each step reads."""

    named_errors: ClassVar[bool] = False  # its messages name the flags

    batch_size: int = option(8, "examples per micro-batch and process, in the task's unit", fixed=True)
    grad_accum: int = option(1, "micro-batches per optimiser step", fixed=True)

    def check(self) -> None:
        """Positive sizes."""
        for name in ("batch_size", "grad_accum"):
            if getattr(self, name) < 1:
                raise QkvError(f"{name.replace('_', '-')} must be a positive integer, got {getattr(self, name)!r}")


@dataclass(frozen=True, kw_only=True)
class EvalConfig(Config):
    """When the run evaluates (and saves)."""

    named_errors: ClassVar[bool] = False  # its messages name the flags

    interval: int = option(300, "steps between evaluations and checkpoints", flag="eval_interval")

    def check(self) -> None:
        """A positive interval."""
        if self.interval < 1:
            raise QkvError(f"eval-interval must be a positive integer, got {self.interval!r}")


@dataclass(frozen=True, kw_only=True)
class SystemConfig(Config):
    """Where and how the run computes."""

    named_errors: ClassVar[bool] = False  # its messages name the flags

    device: str = option("auto", "auto, cpu, cuda, cuda:N or mps")
    dtype: Dtype = option("auto", "autocast dtype, weights stay float32 (auto: bfloat16 with TF32 matmuls on CUDA, "
                          "float32 elsewhere; float32: full precision everywhere)")  # fmt: skip
    compile: bool = option(False, "torch.compile each Transformer layer (whole graphs only: a graph break is an "
                           "error); works with ddp and fsdp")  # fmt: skip
    activation_checkpointing: bool = option(False, "recompute each layer's activations in the backward pass instead "
                                            "of keeping them: less memory, one more forward per layer")  # fmt: skip
    cpu_threads: int | None = option(None, "intra-op CPU threads (none: one per core)")
    strategy: Strategy = option("ddp", "with several processes: ddp, or fsdp (sharded parameters)")
    dist_timeout: float = option(1800.0, "seconds a collective waits for a slow, dead or hung process (a rank "
                                 "waits at a checkpoint while the others write theirs)")  # fmt: skip
    seed: int = option(1337, "random seed (weights, batches, dropout)", fixed=True)

    def check(self) -> None:
        """Positive thread counts and timeouts."""
        if self.cpu_threads is not None and self.cpu_threads < 1:
            raise QkvError(f"cpu-threads must be a positive integer, got {self.cpu_threads!r}")
        if self.dist_timeout <= 0:
            raise QkvError(f"dist-timeout must be positive seconds, got {self.dist_timeout}")


@dataclass(frozen=True, kw_only=True)
class CheckpointConfig(Config):
    """Where the run lives, and how it saves."""

    named_errors: ClassVar[bool] = False  # its messages name the flags

    out_dir: str | None = option(None, "run directory (none: runs/<task name>-<date>-<time>)")
    resume: bool = option(False, "continue the run in --out-dir")
    async_save: bool = option(False, "write checkpoints in a background thread while training goes on (the state "
                              "is first copied to memory; committed when written)",
                              flag="async_checkpoint")  # fmt: skip


@dataclass(frozen=True, kw_only=True)
class RunConfig(Config, Generic[M]):
    """A whole run: the model, the sections every task has, and (in a task's config) the task's own settings."""

    task: ClassVar[str] = ""  # the task's name in qkv.tasks' registry
    model_class: ClassVar[type[ModelConfig]] = ModelConfig  # the kind of model the task trains
    paths: ClassVar[tuple[str, ...]] = ()  # settings that name files: stored absolute, for eval and resume anywhere

    model: M = option(help="the model; --model KEY=VALUE sets its settings", fixed=True)
    optim: OptimConfig = OptimConfig()
    schedule: ScheduleConfig = ScheduleConfig()
    data: DataConfig = DataConfig()
    eval: EvalConfig = EvalConfig()
    system: SystemConfig = SystemConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()

    def check(self) -> None:
        """The rules that tie sections to each other, and the model's kind."""
        if not isinstance(self.model, self.model_class):
            raise QkvError(f"a {self.task} run trains a {self.model_class.__name__}, got {type(self.model).__name__}")
        min_lr = self.schedule.min_lr
        if min_lr is not None and not 0 <= min_lr <= self.optim.lr:
            raise QkvError(f"min-lr must be in [0, lr={self.optim.lr}], got {min_lr}")

    @property
    def final_lr(self) -> float:
        """The learning rate at the end of the schedule."""
        return self.optim.lr / 20 if self.schedule.min_lr is None else self.schedule.min_lr

    @classmethod
    def from_dict(cls: type[R], data: Mapping[str, Any], path: str = "") -> R:
        """Build from a dict; its model entry as the task's kind of model config; errors name the flags."""
        data = dict(data)
        if isinstance(data.get("model"), Mapping):
            data["model"] = cls.model_class.from_dict(data["model"], "model")
        try:
            return super().from_dict(data, path)
        except QkvError as e:
            message = str(e)
            for flag, where in cls.flags().items():  # "optim.name must be …" → "--optimizer must be …"
                if message.startswith(f"{where} "):
                    message = f"--{flag.replace('_', '-')}{message[len(where):]}"
            raise QkvError(message) from None

    @classmethod
    def flags(cls) -> dict[str, str]:
        """Every setting's command-line name (underscores) → its dotted path, the model's excepted."""
        return {flag: path for flag, path, _, _ in setting_fields(cls)}

    def expand(self, key: str) -> list[str]:
        """A flag's path, or the key itself (a dotted path)."""
        return [self.flags().get(key, key)]

    def override(self: R, settings: Mapping[str, Any]) -> R:
        """A new config with settings changed: flags or dotted paths; model.* settings as the model config takes
        them (short paths and flat keys too)."""
        settings = dict(settings)
        whole = settings.pop("model", None)  # a model config replaces the model; a dict holds model settings
        updated = self if not isinstance(whole, ModelConfig) else dataclasses.replace(self, model=whole)
        if isinstance(whole, Mapping):
            settings |= {f"model.{k}": v for k, v in whole.items()}
        elif whole is not None and not isinstance(whole, ModelConfig):
            raise QkvError(f"model must be a {self.model_class.__name__} or a dict of its settings, got {whole!r}")
        model = {k.removeprefix("model."): v for k, v in settings.items() if k.startswith("model.")}
        rest = {k: v for k, v in settings.items() if not k.startswith("model.")}
        rest = {k: absolute(v) if self.expand(k)[0] in self.paths else v for k, v in rest.items()}
        if model:
            updated = dataclasses.replace(updated, model=_model_override(updated.model, model))
        return Config.override(updated, rest) if rest else updated

    def training_dict(self) -> dict[str, Any]:
        """config.json's "training": every setting but the model's (stored beside it, whole)."""
        return {k: v for k, v in self.to_dict().items() if k != "model"}

    @classmethod
    def from_stored(cls: type[R], stored: Mapping[str, Any]) -> R:
        """A run's config from its config.json (the "training" and "model" entries; flat ones of earlier versions)."""
        training = dict(stored["training"])
        if "optim" not in training:
            training = cls._from_flat(training)
        return cls.from_dict({**training, "model": stored["model"]})

    @classmethod
    def _from_flat(cls, flat: Mapping[str, Any]) -> dict[str, Any]:
        """A flat run config (each setting under its flag's name) as nested sections."""
        flags, nested = cls.flags(), dict[str, Any]()
        # Muon's iterations were the task's then, not a setting: the language model's 4, every other task's 5.
        flat = {"newton_schulz_steps": 4 if cls.task == "lm" else 5, **flat}
        for key, value in flat.items():
            if key == "model" or (key.startswith("lora_") and flat.get("lora_rank") is None):
                continue  # the whole model is stored beside it; a run without adapters has no LoRA section
            if key not in flags:
                raise QkvError(f"unknown {cls.task or 'training'} setting {key!r} in a stored run config")
            if key == "lora_targets" and isinstance(value, str):
                value = [t.strip() for t in value.split(",") if t.strip()]
            *parents, leaf = flags[key].split(".")
            place = nested
            for part in parents:
                place = place.setdefault(part, {})
            place[leaf] = value
        return nested

    @classmethod
    def resume(cls: type[R], stored: Mapping[str, Any], settings: Mapping[str, Any]) -> R:
        """The stored run's config with `settings` (given on resume) laid over it; what it trains may not change."""
        kept = cls.from_stored(stored)
        resumed = kept.override({**settings, "checkpoint.resume": True})
        fixed = {path for _, path, f, _ in setting_fields(cls) if f.metadata.get("fixed")}
        for flag, path in cls.flags().items():
            if path in fixed and _at(resumed, path) != _at(kept, path):
                raise QkvError(f"--{flag.replace('_', '-')} cannot change on --resume (the run has {path}="
                               f"{_at(kept, path)!r}); drop it")  # fmt: skip
        if resumed.model != kept.model:
            before = dict(kept.model.leaves())
            changed = next(p for p, v in resumed.model.leaves() if before.get(p) != v)
            raise QkvError(f"--model cannot change on --resume (the run has {changed}={before.get(changed)!r}); "
                           "drop it")  # fmt: skip
        return resumed


def _model_override(model: M, settings: dict[str, Any]) -> M:
    """model.override(settings), whose one-line error names the setting given that it comes from, where one does."""
    try:
        return model.override(settings)
    except QkvError as e:
        for key, value in settings.items():
            try:
                model.override({key: value})
            except QkvError:
                raise QkvError(f"--model {key}={value}: {e}") from None
        raise


def setting_fields(cls: type[Config], path: str = "",
                   prefix: str = "") -> Iterator[tuple[str, str, dataclasses.Field[Any], Any]]:  # fmt: skip
    """(flag, dotted path, field, type hint) of every setting of a config class, walking into its sections (not into
    the model)."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.name == "model":
            continue
        hint = hints[f.name]
        section = next((h for h in typing.get_args(hint) or (hint,) if isinstance(h, type) and issubclass(h, Config)),
                       None)  # fmt: skip
        where = f"{path}.{f.name}" if path else f.name
        if section is not None:
            inner = f"{f.metadata['prefix']}_" if f.metadata.get("prefix") else ""
            yield from setting_fields(section, where, prefix + inner)
        else:
            yield prefix + (f.metadata.get("flag") or f.name), where, f, hint


def _at(cfg: object, path: str) -> Any:
    """A setting by dotted path (None inside an absent section)."""
    for part in path.split("."):
        cfg = getattr(cfg, part, None)
    return cfg


def absolute(path: str | None) -> str | None:
    """A data file's absolute path, so that eval and resume find it from any directory (None stays None)."""
    return None if path is None else str(Path(path).expanduser().resolve())
