"""A run directory: what a training run leaves behind, and reading it back (older layouts included).

    config.json              task, model config, run config, tokenizer summary, the data directory read, and the
                             checkpoint a fine-tuning run started from: its path and sha256 (JSON)
    model.safetensors        the best weights (by the task's own measure: val loss, BLEU, …); a LoRA run's
                             adapters only (what trains), its frozen base being the checkpoint config.json names
    last.safetensors         the latest weights
    checkpoint/              everything `--resume` needs: a sharded DCP checkpoint per step and latest.json, which
                             names the committed one (qkv.training.checkpoint); runs of earlier versions kept
                             last_optim.safetensors and last_state.json instead, which no longer resume
    tokenizer.json           the tokenizer (tasks with a fixed vocabulary have none)
    metrics.jsonl            one JSON object per evaluation
    loss.png                 train and validation curves
Loading a run never executes code from it: safetensors and JSON, and DCP's files read with allow-lists.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from torch import Tensor, nn

from qkv.errors import QkvError
from qkv.io.files import PICKLE_SUFFIXES, atomic_write_bytes, atomic_write_json, load_json, load_safetensors

FORMAT = "qkv-run/2"  # nested model and run configs (qkv-run/1: flat ones, read through qkv.io.config_v1)
FORMATS = ("qkv-run/1", FORMAT)
CONFIG_FILE = "config.json"
BEST_FILE = "model.safetensors"
LAST_FILE = "last.safetensors"
OPTIM_FILE = "last_optim.safetensors"
STATE_FILE = "last_state.json"
CHECKPOINT_DIR = "checkpoint"
METRICS_FILE = "metrics.jsonl"
PLOT_FILE = "loss.png"
CHECKPOINTS = ("best", "last")

# Runs written before config.json named its task: the task follows from the model type.
_TASK_OF_MODEL_TYPE = {"decoder_lm": "lm", "transformer": "translate"}
# Task names of runs that named theirs in their own words.
_RENAMED_TASKS = {"translate de-en": "translate"}
# Model-config fields an encoder–decoder task decides itself (from its vocabulary).
_TASK_FIELDS = ("src_vocab_size", "tgt_vocab_size", "share_embeddings", "pad_id")
# Settings renamed since: (task, old name) → new name.
_RENAMED = {("lm", "bpe_vocab_size"): "vocab_size", ("translate", "batch_tokens"): "batch_size"}


def write_run_config(directory: Path, task: str, model_type: str, model: dict[str, Any], training: dict[str, Any],
                     tokenizer: dict[str, Any] | None, data: dict[str, Any] | None = None,
                     base: dict[str, Any] | None = None) -> None:  # fmt: skip
    """Write config.json: the task, the model's config, the run's config, a tokenizer summary, the data read and the
    checkpoint a fine-tuning run started from."""
    config = {"format": FORMAT, "task": task, "model_type": model_type, "model": model, "training": training,
              "tokenizer": tokenizer}  # fmt: skip
    if data is not None:  # where the tokens came from: a data directory (qkv.data.tokens) and its tokenizer
        config["data"] = data
    if base is not None:  # a LoRA run's weights are adapters only: the base is loaded, hash-checked, from here
        config["base"] = base
    atomic_write_json(Path(directory) / CONFIG_FILE, config)


def new_run_refusal(directory: Path) -> str:
    """Why a new run may not be written to `directory` ("" when it may: it is absent or empty); nothing the user
    had is written over, a run of theirs or any other file."""
    directory = Path(directory)
    if directory.exists() and not directory.is_dir():
        return f"--out-dir {directory} is a file; give a directory (a new one, or a run to --resume)"
    if not directory.is_dir() or not any(directory.iterdir()):
        return ""
    if (directory / CONFIG_FILE).is_file():
        saved = (BEST_FILE, LAST_FILE, STATE_FILE, CHECKPOINT_DIR)
        if not any((directory / name).exists() for name in saved):
            return ""  # a run that stopped before its first save: only its own settings to write again
        return f"{directory} already holds a run; pass --resume to continue it or choose another --out-dir"
    return f"--out-dir {directory} already holds other files; give a new or empty directory for the run"


def read_run_config(directory: Path) -> dict[str, Any]:
    """config.json of a run directory in today's layout, with errors that say what is wrong with the directory."""
    directory = Path(directory)
    if not directory.exists():
        raise QkvError(f"run directory {directory} does not exist")
    if not directory.is_dir():
        raise QkvError(f"{directory} is not a directory; pass the run directory that `qkv train` wrote")
    if not (directory / CONFIG_FILE).is_file():
        pickles = sorted(p.name for p in directory.iterdir() if p.suffix in PICKLE_SUFFIXES)
        if pickles:
            names = ", ".join(pickles)
            raise QkvError(f"refusing to load pickle file(s) {names} in {directory}: qkv only reads safetensors")
        raise QkvError(f"{directory} is not a qkv run directory ({CONFIG_FILE} missing)")
    config = load_json(directory / CONFIG_FILE)
    if config.get("format") not in FORMATS or "model" not in config or "training" not in config:
        raise QkvError(f"{directory / CONFIG_FILE} is not a qkv run config (format {config.get('format')!r})")
    return migrate_config(config)


def migrate_config(config: dict[str, Any]) -> dict[str, Any]:
    """A flat config.json (qkv-run/1) of any earlier layout in its last: the task named, renamed settings under their
    new names (the run configs turn it into today's nested one: qkv.training.config.RunConfig.from_stored)."""
    config = dict(config)
    if config.get("format") == FORMAT:
        return config
    model_type = config.setdefault("model_type", "decoder_lm")
    task = config.get("task", _TASK_OF_MODEL_TYPE.get(model_type, model_type))
    training = dict(config["training"])
    if task in _RENAMED_TASKS:  # then `model` held only the fields given in Python, not the recipe's: take them all
        training["model"] = {k: v for k, v in config["model"].items() if k not in _TASK_FIELDS}
    task = config["task"] = _RENAMED_TASKS.get(task, task)
    for (owner, old), new in _RENAMED.items():
        if owner == task and old in training:
            training[new] = training.pop(old)
    training.pop("resume", None)  # how the run was last started, not a setting of the run
    # Settings added since, whose defaults are not what those runs did: every run before them used AdamW, and
    # every translation run before --corpus trained on the Ding sentences. A run on a pairs file has no corpus.
    training.setdefault("optimizer", "adamw")
    if task == "lm" and isinstance(training.get("model"), dict):  # before the recipe's one key/value head
        training["model"] = {"n_kv_heads": None, **training["model"]}
    if task == "translate":
        if training.get("data") is None:
            training.setdefault("corpus", "ding")
        else:
            training.pop("corpus", None)
    config["training"] = training
    return config


def migrate_state(extra: dict[str, Any]) -> dict[str, Any]:
    """A checkpoint's extra state in today's layout (older runs kept the best score under a metric's name)."""
    extra = dict(extra)
    if "best" not in extra:
        extra["best"] = extra.pop("best_val_loss", extra.pop("best_val_bleu", None))
    extra.setdefault("train_s", extra["elapsed_s"])  # checkpoints before train_s existed: no overhead known
    return extra


def check_weights(model: nn.Module, state: dict[str, Tensor], source: Path) -> None:
    """Refuse `state` unless it has exactly the model's tensors with the model's shapes."""
    expected = model.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing:
        raise QkvError(f"{source} lacks tensor(s) {', '.join(missing[:5])}{' …' if len(missing) > 5 else ''}")
    if unexpected:
        raise QkvError(f"{source} has unexpected tensor(s) {', '.join(unexpected[:5])}")
    for name, tensor in state.items():
        if tensor.shape != expected[name].shape:
            want = tuple(expected[name].shape)
            raise QkvError(f"{source}: tensor {name} has shape {tuple(tensor.shape)}, the model expects {want}")


def load_weights(model: nn.Module, state: dict[str, Tensor], source: Path) -> None:
    """Copy `state` into the model, naming any missing, unexpected or mis-shaped tensor."""
    check_weights(model, state, source)
    model.load_state_dict(state)


def load_run_weights(model: nn.Module, directory: Path, checkpoint: str) -> None:
    """Copy a run's best (model.safetensors) or last (last.safetensors) weights into the model."""
    if checkpoint not in CHECKPOINTS:
        raise QkvError(f"checkpoint must be 'best' or 'last', got {checkpoint!r}")
    weights = Path(directory) / (BEST_FILE if checkpoint == "best" else LAST_FILE)
    if not weights.is_file():
        raise QkvError(f"{directory} has no {weights.name} yet (training has not reached its first evaluation)")
    load_weights(model, load_safetensors(weights), weights)


def read_metrics(directory: Path, up_to_step: int | None = None) -> list[dict[str, Any]]:
    """metrics.jsonl rows logged at or before a step (a killed run may have logged past its checkpoint)."""
    path = Path(directory) / METRICS_FILE
    if not path.is_file():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in rows if up_to_step is None or r["step"] <= up_to_step]


def write_metrics(directory: Path, metrics: list[dict[str, Any]]) -> None:
    """Rewrite metrics.jsonl atomically (it is small: one line per evaluation)."""
    atomic_write_bytes(Path(directory) / METRICS_FILE, "".join(json.dumps(m) + "\n" for m in metrics).encode())
