"""The training tasks, and the two calls that use them: `train` and `load`.

    lm         a decoder-only language model on text (the default of `qkv train`)
    translate  the encoder–decoder Transformer, German → English (or any TSV of sentence pairs)
    mlm        masked-language-model pretraining of the encoder-only model (BERT's recipe)
    copy       the Annotated Transformer's sanity check: copy digit sequences
    reverse    … and reverse them
Each task is a config class (its settings) and a Task (what it supplies to the one loop in
qkv.training.loop); a trained run loads back as the task's LoadedRun.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from qkv.errors import QkvError

if TYPE_CHECKING:  # the registry itself stays light: `qkv --help` reads it without importing torch
    import torch

    from qkv.training import Hooks, RunConfig, Task, TrainResult


@dataclass(frozen=True)
class TaskEntry:
    """Where a task's pieces live, and what a run of it is called in messages."""

    module: str
    config: str
    task: str
    run: str
    kind: str  # what a run of it is: "language model", …
    summary: str  # one line for `qkv train --help`


TASKS: dict[str, TaskEntry] = {
    "lm": TaskEntry("qkv.tasks.lm", "LMConfig", "LMTask", "LMRun", "language model",
                    "a decoder-only language model on text (default: the embedded Shakespeare)"),
    "translate": TaskEntry("qkv.tasks.translate", "TranslateConfig", "TranslateTask", "TranslationRun",
                           "translation model", "the encoder–decoder Transformer, German → English (or a TSV)"),
    "mlm": TaskEntry("qkv.tasks.mlm", "MLMConfig", "MLMTask", "MLMRun", "masked language model",
                     "masked-language-model pretraining of the encoder-only model (BERT's recipe)"),
    "copy": TaskEntry("qkv.tasks.toy", "CopyConfig", "ToyTask", "ToyRun", "copy-task model",
                      "sanity check: copy random digit sequences"),
    "reverse": TaskEntry("qkv.tasks.toy", "ReverseConfig", "ReverseTask", "ReverseRun", "reverse-task model",
                         "sanity check: reverse random digit sequences"),
}  # fmt: skip


def _entry(task: str) -> TaskEntry:
    """The registry entry of a task, or a one-line error naming the tasks there are."""
    if task not in TASKS:
        raise QkvError(f"unknown task {task!r}; choose one of: {', '.join(TASKS)}")
    return TASKS[task]


def _part(task: str, which: str) -> Any:
    """One of a task's classes (config, task or run), imported on first use."""
    entry = _entry(task)
    return getattr(importlib.import_module(entry.module), getattr(entry, which))


def config_class(task: str) -> type[RunConfig]:
    """The config class of a task (LMConfig for "lm", …)."""
    cls: type[RunConfig] = _part(task, "config")
    return cls


def task_class(task: str) -> type[Task]:
    """The Task class of a task."""
    cls: type[Task] = _part(task, "task")
    return cls


def task_run(task: str) -> Any:
    """The LoadedRun class of a task's runs."""
    return _part(task, "run")


def train(
    config: RunConfig | None = None, *, task: str = "lm", verbose: bool = True, hooks: Hooks | None = None,
    **settings: Any,
) -> TrainResult:  # fmt: skip
    """Train a task: `train(LMConfig(...))`, or `train(task="translate", max_steps=100)` with its config's fields."""
    from qkv.training import fit

    if config is None:
        config = config_class(task)(**settings)
    elif settings:
        raise QkvError(f"pass settings in the config or as keywords, not both (got {', '.join(settings)})")
    return fit(task_class(config.task), config, verbose, hooks)


def load(
    run_dir: str | Path, checkpoint: str = "best", device: str | torch.device = "cpu", expect: str | None = None
) -> Any:
    """A run directory's model (best or last weights), tokenizer and settings, as its task's LoadedRun.

    expect: a task name; a run of another task is refused with a one-line error.
    """
    from qkv.io.run_dir import read_run_config

    stored = read_run_config(Path(run_dir))
    if expect is not None and stored["task"] != expect:
        raise QkvError(f"{run_dir} holds a {stored['task']} run, not a {_entry(expect).kind}")
    return task_run(stored["task"]).load(Path(run_dir), checkpoint, device, stored)


__all__ = ["TASKS", "TaskEntry", "config_class", "load", "task_class", "task_run", "train"]
