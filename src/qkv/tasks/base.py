"""A trained run loaded back: its model, tokenizer and settings, and what `qkv eval` reports for it."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal, TypeVar

import torch

from qkv.errors import QkvError
from qkv.io.run_dir import load_run_weights, read_run_config
from qkv.models import QkvModel
from qkv.tokenizers import Tokenizer
from qkv.training import RunConfig


def read_tokenizer(directory: Path) -> Tokenizer | None:
    """A run directory's tokenizer: qkv's (tokenizer.json), a MarianMT model's it was fine-tuned from, or None."""
    from qkv.interop.marian_tokenizer import read_tokenizer as read_any  # imports no optional package

    return read_any(directory)


@dataclass(frozen=True)
class EvalOptions:
    """`qkv eval`'s options; each task reads the ones it has a use for and refuses the others it is given."""

    batch_size: int = 32
    beam: int = 4
    length_penalty: float | None = None
    coverage_penalty: float | None = None
    beam_scoring: Literal["gnmt", "hf"] | None = None  # qkv.translation.run.Translator's; None = the run's

    def __post_init__(self) -> None:
        """Refuse sizes below 1 and unknown scorings by name."""
        if self.batch_size < 1:
            raise QkvError(f"batch size must be at least 1, got {self.batch_size}")
        if self.beam < 1:
            raise QkvError(f"--beam must be ≥ 1, got {self.beam}")
        if self.beam_scoring not in (None, "gnmt", "hf"):
            raise QkvError(f"unknown beam scoring {self.beam_scoring!r}; choose one of: gnmt, hf")

    def refuse_beam_options(self, task: str) -> None:
        """A one-line error when beam-search options are given for a task that does not decode with a beam."""
        if self.length_penalty is not None or self.coverage_penalty is not None or self.beam_scoring is not None:
            raise QkvError(f"--length-penalty, --coverage-penalty and --beam-scoring are for translation runs (beam "
                           f"search), not {task} runs")  # fmt: skip


R = TypeVar("R", bound="LoadedRun")


@dataclass
class LoadedRun:
    """A trained model with its tokenizer (None for a fixed vocabulary) and its run settings, in eval mode."""

    model: QkvModel
    tokenizer: Tokenizer | None
    config: RunConfig[Any]
    directory: Path
    checkpoint: str  # "best" or "last": which weights were loaded

    config_class: ClassVar[type[RunConfig[Any]]] = RunConfig

    @classmethod
    def load(
        cls: type[R],
        directory: Path,
        checkpoint: str = "best",
        device: str | torch.device = "cpu",
        stored: dict[str, Any] | None = None,
    ) -> R:
        """Read a run directory of this task: config.json (unless `stored` has it), the weights, the tokenizer."""
        stored = read_run_config(directory) if stored is None else stored
        config = cls.config_class.from_stored(stored)
        model = config.model.build()
        load_run_weights(model, directory, checkpoint)
        tokenizer = read_tokenizer(directory)
        return cls(model.to(device).eval(), tokenizer, config, Path(directory), checkpoint)

    @property
    def device(self) -> torch.device:
        """Where the model's weights live."""
        return next(self.model.parameters()).device

    @property
    def task(self) -> str:
        """The task the run was trained on."""
        return self.config.task

    def evaluate(self, options: EvalOptions) -> list[str]:
        """`qkv eval`: the task's measures on its held-out split, one line each."""
        raise QkvError(f"`qkv eval` has nothing to measure for a {self.task} run")

    def require_tokenizer(self) -> Tokenizer:
        """The run's tokenizer, or a one-line error for a run that has none."""
        if self.tokenizer is None:
            raise QkvError(f"{self.directory} has no tokenizer ({self.task} runs use a fixed vocabulary)")
        return self.tokenizer
