"""The training tasks, their recipes, and the calls that use them: `recipe`, `train` and `load`.

    lm         a decoder-only language model on text (the default of `qkv train`); from a checkpoint
               (--init-from): fine-tuning (qkv.tasks.finetune), on conversations: chat (qkv.tasks.chat)
    dpo        a checkpoint tuned on preference pairs (direct preference optimisation)
    grpo       a checkpoint tuned by its own sampled replies' rewards (group relative policy optimisation)
    translate  the encoder–decoder Transformer, German → English (or any TSV of sentence pairs)
    mlm        masked-language-model pretraining of the encoder-only model (BERT's recipe)
    copy       the Annotated Transformer's sanity check: copy digit sequences
    reverse    … and reverse them
    sae        a sparse autoencoder on a frozen model's activations at one hook (`qkv interpret sae train`)
Each task is a config class (its settings), a recipe (a function returning the whole config of its default run), a
Task (what it supplies to the one loop in qkv.training.loop) and a LoadedRun (a trained run loaded back). This
registry is the one place that picks them: a base class never imports its variants.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
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
    recipe: str = "recipe"  # the module's function returning the task's default config


TASKS: dict[str, TaskEntry] = {
    "lm": TaskEntry("qkv.tasks.lm", "LMConfig", "LMTask", "LMRun", "language model",
                    "a decoder-only language model on text (default: the embedded Shakespeare)"),
    "dpo": TaskEntry("qkv.tasks.dpo", "DPOConfig", "DPOTask", "DPORun", "DPO-tuned language model",
                     "a checkpoint tuned on preference pairs: --init-from CHECKPOINT --data prefs.jsonl (DPO)"),
    "grpo": TaskEntry("qkv.tasks.grpo", "GRPOConfig", "GRPOTask", "GRPORun", "GRPO-tuned language model",
                      "a checkpoint tuned on the rewards of its own replies: --init-from CKPT --data prompts.jsonl"),
    "translate": TaskEntry("qkv.tasks.translate", "TranslateConfig", "TranslateTask", "TranslationRun",
                           "translation model", "the encoder–decoder Transformer, German → English (or a TSV)"),
    "mlm": TaskEntry("qkv.tasks.mlm", "MLMConfig", "MLMTask", "MLMRun", "masked language model",
                     "masked-language-model pretraining of the encoder-only model (BERT's recipe)"),
    "copy": TaskEntry("qkv.tasks.toy", "CopyConfig", "ToyTask", "ToyRun", "copy-task model",
                      "sanity check: copy random digit sequences"),
    "reverse": TaskEntry("qkv.tasks.toy", "ReverseConfig", "ReverseTask", "ReverseRun", "reverse-task model",
                         "sanity check: reverse random digit sequences", recipe="reverse_recipe"),
    "sae": TaskEntry("qkv.tasks.sae", "SAETrainConfig", "SAETask", "SAERun", "sparse autoencoder",
                     "a sparse autoencoder on a model's activations: --lm MODEL --hook NAME --data DIR"),
}  # fmt: skip
# A language model that starts from a checkpoint: fine-tuning, or chat on a file of conversations.
FINETUNE = TaskEntry("qkv.tasks.finetune", "LMConfig", "FinetuneTask", "FinetunedRun", "fine-tuned language model",
                     "fine-tuning a checkpoint on text")  # fmt: skip
CHAT = TaskEntry("qkv.tasks.chat", "LMConfig", "ChatTask", "ChatRun", "chat model", "fine-tuning on conversations")
LORA_FLAGS = ("lora_rank", "lora_alpha", "lora_dropout", "lora_targets")
LANGUAGE_MODELS = ("lm", "dpo", "grpo")  # tasks whose runs are causal language models (chat, serve, eval --bench)


def _entry(task: str) -> TaskEntry:
    """The registry entry of a task, or a one-line error naming the tasks there are."""
    if task not in TASKS:
        raise QkvError(f"unknown task {task!r}; choose one of: {', '.join(TASKS)}")
    return TASKS[task]


def _part(entry: TaskEntry, which: str) -> Any:
    """One of a task's pieces (config, task, run or recipe), imported on first use."""
    return getattr(importlib.import_module(entry.module), getattr(entry, which))


def _variant(cfg: RunConfig[Any]) -> TaskEntry:
    """The entry whose task and run classes train and load `cfg`: the task's own, or fine-tuning or chat for a
    language model that starts from a checkpoint."""
    if cfg.task != "lm" or getattr(cfg, "init_from", None) is None:
        return _entry(cfg.task)
    from qkv.chat import is_chat_file

    return CHAT if is_chat_file(getattr(cfg, "source", None)) else FINETUNE


def config_class(task: str) -> type[RunConfig[Any]]:
    """The config class of a task (LMConfig for "lm", …)."""
    cls: type[RunConfig[Any]] = _part(_entry(task), "config")
    return cls


def task_class(cfg: RunConfig[Any]) -> type[Task]:
    """The Task class that trains `cfg`."""
    cls: type[Task] = _part(_variant(cfg), "task")
    return cls


def run_class(cfg: RunConfig[Any]) -> Any:
    """The LoadedRun class of a run of `cfg`."""
    return _part(_variant(cfg), "run")


def recipe(task: str = "lm", settings: Mapping[str, Any] | None = None) -> RunConfig[Any]:
    """The task's recipe with `settings` (flags such as lr, or dotted paths) over it.

    A language model that starts from a checkpoint (init_from) takes the fine-tuning recipe layered on the language
    model's (LoRA's with lora_rank), and chat's on that for a file of conversations.
    """
    settings = dict(settings or {})
    cfg: RunConfig[Any] = _part(_entry(task), "recipe")()
    init_from = settings.get("init_from")
    if task in LANGUAGE_MODELS and init_from is not None:
        cfg = _finetune_recipe(cfg, settings)
    elif task in LANGUAGE_MODELS and any(settings.get(flag) is not None for flag in LORA_FLAGS):
        raise QkvError("--lora-rank and the other LoRA settings adapt a pretrained model; add --init-from CHECKPOINT")
    return cfg.override(settings)


def _finetune_recipe(cfg: RunConfig[Any], settings: dict[str, Any]) -> RunConfig[Any]:
    """The language model's recipe with fine-tuning's (LoRA's, with lora_rank) and chat's (a conversation file)."""
    from qkv.chat import is_chat_file
    from qkv.lora import LoRAConfig
    from qkv.tasks import chat, finetune
    from qkv.training.config import absolute

    lora_given = sorted(f for f in LORA_FLAGS if settings.get(f) is not None)
    if lora_given and "lora_rank" not in lora_given:
        raise QkvError(f"--{lora_given[0].replace('_', '-')} needs --lora-rank R (without it every weight trains)")
    lora = LoRAConfig() if lora_given else None
    init_from = absolute(settings["init_from"])
    assert init_from is not None
    tuned = finetune.recipe(cfg, init_from, lora)  # type: ignore[arg-type]
    if cfg.task in ("dpo", "grpo"):  # post-training: its own rates over fine-tuning's
        post = importlib.import_module(f"qkv.tasks.{cfg.task}")
        return post.tuned(tuned)
    return chat.recipe(tuned) if is_chat_file(settings.get("data", settings.get("source"))) else tuned


def train(config: RunConfig[Any] | None = None, *, task: str = "lm", verbose: bool = True, hooks: Hooks | None = None,
          **settings: Any) -> TrainResult:  # fmt: skip
    """Train: `train(config)`, or `train(task="translate", max_steps=100)` with settings over the task's recipe.

    Resuming (resume=True, out_dir=RUN) continues the run with its stored settings, the ones given laid over them.
    """
    from qkv.training import fit

    if config is not None and settings:
        raise QkvError(f"pass settings in the config or as keywords, not both (got {', '.join(settings)})")
    if config is None:
        config = resumed(task, settings) if settings.get("resume") else recipe(task, settings)
    return fit(task_class(config), config, verbose, hooks)


def resumed(task: str, settings: Mapping[str, Any]) -> RunConfig[Any]:
    """The config of the run `settings` resume (resume=True, out_dir=RUN): its stored one, the settings over it."""
    from qkv.io.run_dir import read_run_config

    out_dir = settings.get("out_dir")
    if not out_dir:
        raise QkvError("--resume needs --out-dir: the run directory to continue")
    stored = read_run_config(Path(out_dir))
    if stored["task"] != task:
        raise QkvError(f"{out_dir} holds a {stored['task']} run; continue it with `qkv train {stored['task']} "
                       f"--resume --out-dir {out_dir}`")  # fmt: skip
    return config_class(task).resume(stored, settings)


def load(path: str | Path, checkpoint: str = "best", device: str | torch.device = "cpu", expect: str | None = None,
         role: str = "MODEL", native: bool = False) -> Any:  # fmt: skip
    """A run directory's model (best or last weights), tokenizer and settings, as its task's LoadedRun; or the
    language model of a .gguf file, a Hugging Face directory or a `qkv convert` directory, as a language-model run.

    expect: a task name; a model of another task is refused with a one-line error. role: the command that reads
    the model, for messages. native: a GGUF file's quantised matrices stay quantised (for inference).
    """
    from qkv.io.run_dir import read_run_config
    from qkv.tasks.checkpoint import load_checkpoint, run_task

    where = Path(path)
    if run_task(where) is None:
        wanted = None if expect in (None, "lm") else f"{_entry(expect).kind}; give a run of `qkv train {expect}`"
        return load_checkpoint(where, device, wanted, role, native)
    stored = read_run_config(where)
    if expect is not None and stored["task"] != expect and not {stored["task"], expect} <= set(LANGUAGE_MODELS):
        raise QkvError(f"{path} holds a {_entry(stored['task']).kind} run, not a {_entry(expect).kind}")
    cfg = config_class(stored["task"]).from_stored(stored)
    return run_class(cfg).load(where, checkpoint, device, stored)


__all__ = ["LANGUAGE_MODELS", "TASKS", "TaskEntry", "config_class", "load", "recipe", "resumed", "run_class",
           "task_class", "train"]
