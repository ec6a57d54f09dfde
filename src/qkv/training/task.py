"""A task: the small object that tells the one training loop what differs between trainings.

The loop (qkv.training.loop) owns the optimiser, schedule, accumulation, precision, compile,
processes, time budget, evaluation cadence, checkpoints and logs. A task supplies only:
its data (and tokenizer), its model, its batches, its loss (the model's logits for a batch, and the
criterion that scores them), its evaluation, which evaluation keeps the best weights, and what to show at
the end. The tasks are in qkv.tasks.
"""

from __future__ import annotations

import contextlib
import itertools
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import torch
from torch import Tensor, nn

from qkv.errors import QkvError
from qkv.io.devices import autocast_context
from qkv.lora import LoRAConfig
from qkv.models import QkvConfig
from qkv.tokenizers import Tokenizer
from qkv.training.config import RunConfig

if TYPE_CHECKING:
    from qkv.training.distributed import DistContext


class Batch(Protocol):
    """One micro-batch on its device: the loss averages over its n_targets positions."""

    @property
    def n_targets(self) -> int:
        """Positions the loss counts (padding and positions without a target excluded)."""

    @property
    def n_tokens(self) -> int:
        """Tokens the model read, for tokens/s."""


@dataclass
class Evaluation:
    """What a task's evaluation gets: the model, the callable for loss passes, and where it runs."""

    model: nn.Module  # the plain model, in eval mode (for decoding: encode, decode, …)
    forward: Callable[..., Any]  # the model as the loop calls it (compiled, or wrapped for several processes)
    ctx: DistContext
    dtype: str
    full: bool  # True: the last evaluation (a task's periodic ones may read less)
    tokens_seen: int = 0  # tokens the run has trained on so far, all processes together
    progress: Callable[[int, int], None] | None = None  # (batches done, in all), for a task's loop over batches

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        """The run's mixed-precision context."""
        return autocast_context(self.ctx.device, self.dtype)


@dataclass
class TrainResult:
    """What a run achieved and where it lives."""

    run_dir: Path
    task: str
    step: int
    final: dict[str, float]  # the final evaluation over whole splits (val_loss, and the task's own measures)
    best: float | None  # the best value of the task's best_metric across the run's evaluations
    elapsed_s: float
    interrupted: bool = False
    metrics: list[dict[str, Any]] = field(default_factory=list)
    trained: Task | None = field(default=None, repr=False, compare=False)  # the task, for its summary
    started: float | None = None  # time.monotonic() when the run began (its data read, its model built)

    @property
    def val_loss(self) -> float:
        """The final validation loss (the `qkv eval` protocol of the task)."""
        return self.final.get("val_loss", float("nan"))

    def took(self) -> str:
        """'17 s of training and evaluation, 21 s since the run began': what each figure counts."""
        since = "" if self.started is None else f", {time.monotonic() - self.started:.0f} s since the run began"
        return f"{self.elapsed_s:.0f} s of training and evaluation{since}"

    def summary(self) -> str:
        """What the task shows when training ends (`qkv train` prints it)."""
        if self.trained is None:
            return f"{self.task} run in {self.run_dir}: {self.step} steps"
        return self.trained.summary(self)


class Task(ABC):
    """What one kind of training supplies to the loop (see the module docstring)."""

    name: ClassVar[str]
    best_metric: ClassVar[str] = "val_loss"  # which evaluation result keeps model.safetensors
    higher_is_better: ClassVar[bool] = False
    dynamic_shapes: ClassVar[bool] = False  # batch shapes vary: torch.compile must not specialise on them

    def __init__(self, cfg: RunConfig[Any]) -> None:
        self.cfg = cfg
        self.tokenizer: Tokenizer | None = None  # tasks with a fixed vocabulary have none

    @classmethod
    def run_name(cls, cfg: RunConfig[Any]) -> str:
        """The default run directory's name, before its timestamp."""
        return cls.name

    @abstractmethod
    def setup(self, run_dir: Path, resume: bool) -> None:
        """Prepare the data and the tokenizer (on resume, the run's own tokenizer from run_dir)."""

    @abstractmethod
    def model_config(self) -> QkvConfig:
        """The model to train: the run config's, with what the task decides filled in (vocabulary, context, …)."""

    def build_model(self) -> nn.Module:
        """The model to train, freshly initialised from the global RNG (seeded by the loop)."""
        return self.model_config().build()

    def lora_config(self) -> LoRAConfig | None:
        """The LoRA adapters the loop puts beside the model's frozen weights (none: every weight trains)."""
        return None

    def describe(self) -> str:
        """The data, for the run's first log line (e.g. '1,017,684 train / 113,076 val tokens, vocab 78')."""
        return ""

    @abstractmethod
    def draw(self, generator: torch.Generator, budget: int, parts: int) -> Any:
        """One optimiser step's examples for every process, from `generator` alone.

        budget: the run's global batch (batch_size × processes of its first session, kept on resume) ×
        grad_accum, in the task's batch unit (sequences, tokens).
        The loop cuts the result into `parts` micro-batches (contiguous, near-equal slices), so the
        examples must support len() and slicing, and hold at least `parts` of them.
        """

    @abstractmethod
    def collate(self, examples: Any, device: torch.device) -> Any:
        """The tensors of one micro-batch of examples, on device: a Batch."""

    @abstractmethod
    def logits(self, model: Callable[..., Any], batch: Any) -> Tensor:
        """What the model predicts for the batch's targets, e.g. (B, T, V) logits: the input of criterion."""

    @abstractmethod
    def criterion(self, logits: Tensor, batch: Any) -> Tensor:
        """The mean loss of `logits` over the batch's n_targets positions."""

    def loss(self, model: Callable[..., Any], batch: Any) -> Tensor:
        """The mean loss over the batch's n_targets positions (the loop weights micro-batches by them).

        It is two methods so that --compile can compile the criterion on its own where the model is compiled per
        layer (several processes: qkv.training.compiled).
        """
        return self.criterion(self.logits(model, batch), batch)

    @abstractmethod
    def evaluate(self, ev: Evaluation) -> dict[str, float]:
        """Validation measures, each named val_*: val_loss and the task's own (every process calls this)."""

    def after_step(self, step: int, is_main: bool) -> None:  # noqa: B027 (a hook: most tasks have no use for it)
        """Called after each optimiser step (step: the steps done), on every process: a task's own per-step log."""

    def progress_note(self) -> str:
        """The task's own measures of its latest step for the progress bar, ending in two spaces (none: "")."""
        return ""

    @property
    def partial_evaluation(self) -> bool:
        """True if periodic evaluations read only part of the validation split (the final one reads it all)."""
        return False

    def summary(self, result: TrainResult) -> str:
        """What `qkv train` shows when the run ends."""
        return f"val loss {result.val_loss:.4f} after {result.step} steps, {result.took()}"

    def save(self, run_dir: Path) -> None:
        """Write the task's own files into a new run directory (the tokenizer)."""
        if self.tokenizer is not None:
            self.tokenizer.save(run_dir)

    def data_summary(self) -> dict[str, Any] | None:
        """config.json's data entry: where the run's tokens come from (tasks that read a data directory)."""
        return None

    def base_summary(self) -> dict[str, Any] | None:
        """config.json's base entry: the checkpoint a fine-tuning run started from (path, sha256, kind)."""
        return None

    def tokenizer_summary(self) -> dict[str, Any] | None:
        """config.json's tokenizer entry."""
        if self.tokenizer is None:
            return None
        return {"kind": self.tokenizer.kind, "vocab_size": self.tokenizer.vocab_size}


def split(examples: Sequence[Any], parts: int) -> list[Sequence[Any]]:
    """`parts` contiguous slices of near-equal length (the first ones one longer where it does not divide)."""
    if len(examples) < parts:
        raise QkvError(f"a step's batch holds {len(examples)} examples, fewer than its {parts} micro-batches × "
                       "processes; raise --batch-size")  # fmt: skip
    size, extra = divmod(len(examples), parts)
    bounds = [i * size + min(i, extra) for i in range(parts + 1)]
    return [examples[a:b] for a, b in itertools.pairwise(bounds)]
