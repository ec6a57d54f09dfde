"""Any causal language model qkv loads, for scoring: a run (LoRA runs merged onto their base), a `qkv convert`
directory, a Hugging Face directory or a GGUF file."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from qkv.errors import QkvError
from qkv.models import DecoderLM
from qkv.tokenizers import Tokenizer

ROLE = "MODEL"  # how messages name the checkpoint's argument
RESULTS_FILE = "bench.json"


@dataclass
class EvalModel:
    """A causal LM ready to score: its model (eval mode, on its device), tokenizer, and what to call it."""

    model: DecoderLM
    tokenizer: Tokenizer
    name: str
    results: Path  # where its results JSON goes by default: in the run or checkpoint directory
    metadata: dict[str, Any] = field(default_factory=dict)  # a checkpoint file's special ids and chat template


def load_eval_model(path: str | Path, checkpoint: str = "best", device: str | torch.device = "cpu",
                    use: str = "--bench and --bpb score", native: bool = False) -> EvalModel:  # fmt: skip
    """The causal LM at `path` (qkv.tasks.load: a run or any checkpoint), or a one-line error saying what it is
    instead and what to do (use: what the command does with it, for messages; native: a GGUF's quantised matrices
    kept quantised)."""
    from qkv.tasks import LANGUAGE_MODELS, load
    from qkv.tasks.checkpoint import CheckpointRun, run_task

    where = Path(path)
    task = run_task(where)
    if task is not None and task not in LANGUAGE_MODELS:
        also = f"; `qkv eval {where}` gives its task's own measures" if use.startswith("--bench") else ""
        raise QkvError(f"{where} is a `qkv train {task}` run; {use} causal language models (runs of `qkv train`, "
                       f"GGUF or Hugging Face checkpoints){also}")  # fmt: skip
    run = load(where, checkpoint, device, expect="lm", role=ROLE, native=native)
    if not isinstance(run.model, DecoderLM):
        raise QkvError(f"{where} holds a {type(run.model).__name__}; {use} decoder-only language models")
    if isinstance(run, CheckpointRun):
        name, metadata = (where.stem if where.is_file() else where.name), run.metadata
        # a file (a GGUF inside an installed package, say) is not a place to write to: the current directory is
        results = Path(f"{where.stem}.{RESULTS_FILE}") if where.is_file() else where / RESULTS_FILE
    else:
        name, metadata, results = where.name, {}, where / RESULTS_FILE
    return EvalModel(run.model.eval().requires_grad_(False), run.require_tokenizer(), name, results, metadata)
