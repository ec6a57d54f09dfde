"""Any causal language model qkv loads, for scoring: a run (LoRA runs merged onto their base), a `qkv convert`
directory, a Hugging Face directory or a GGUF file."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from qkv.errors import QkvError
from qkv.io.files import load_json
from qkv.models import DecoderLM
from qkv.tokenizers import Tokenizer

ROLE = "qkv eval --bench/--bpb"  # how messages name the checkpoint's option
RESULTS_FILE = "bench.json"


@dataclass
class EvalModel:
    """A causal LM ready to score: its model (eval mode, on its device), tokenizer, and what to call it."""

    model: DecoderLM
    tokenizer: Tokenizer
    name: str
    results: Path  # where its results JSON goes by default: in the run or checkpoint directory
    metadata: dict[str, Any] = field(default_factory=dict)  # a checkpoint file's special ids and chat template


def _task_of(path: Path) -> str | None:
    """The task of a qkv run directory (None: not a run)."""
    config = path / "config.json"
    if not (path.is_dir() and config.is_file()):
        return None
    stored = load_json(config)
    return stored.get("task") if isinstance(stored, dict) and "training" in stored else None


def load_eval_model(path: str | Path, checkpoint: str = "best", device: str | torch.device = "cpu",
                    role: str = ROLE) -> EvalModel:  # fmt: skip
    """The causal LM at `path`, or a one-line error saying what it is instead and what to do (role: the command
    that reads it, for messages)."""
    from qkv.finetune.base import load_base
    from qkv.tasks import load

    where = Path(path)
    task = _task_of(where)
    if task is not None and task != "lm":
        what, also = ("--bench and --bpb score", f"; `qkv eval {where}` gives its task's own measures") \
            if role == ROLE else (f"{role} takes", "")  # fmt: skip
        raise QkvError(f"{where} is a `qkv train {task}` run; {what} causal language models (runs of "
                       f"`qkv train`, GGUF or Hugging Face checkpoints){also}")  # fmt: skip
    if task == "lm":
        run = load(where, checkpoint, device, expect="lm")
        model, tokenizer = run.model, run.require_tokenizer()
        name, results = where.name, where / RESULTS_FILE
    else:
        base = load_base(where, role=role)
        model, tokenizer = base.model.to(device), base.tokenizer
        name = where.stem if where.is_file() else where.name
        # a file (a GGUF inside an installed package, say) is not a place to write to: the current directory is
        results = Path(f"{where.stem}.{RESULTS_FILE}") if where.is_file() else where / RESULTS_FILE
    if not isinstance(model, DecoderLM):
        raise QkvError(f"{where} holds a {type(model).__name__}; {role} takes decoder-only language models")
    metadata = {} if task == "lm" else dict(base.reference.get("metadata") or {})
    return EvalModel(model.eval().requires_grad_(False), tokenizer, name, results, metadata)
