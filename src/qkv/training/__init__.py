"""Training: the one loop every task runs through, its run config, checkpoints, schedule and processes.

    loop.py         fit(): the loop (optimiser, accumulation, precision, compile, DDP/FSDP, budget, checkpoints)
    task.py         Task: what a task supplies to the loop (data, model, batches, loss, evaluation, report)
    config.py       RunConfig: the settings every task shares, in sections, each defined and validated once
    checkpoint.py   crash-safe training state (weights, optimiser, RNGs) for exact resume
    distributed.py  DDP and FSDP under torchrun
    recompute.py    activation checkpointing: each layer recomputed in the backward pass
    evaluate.py     the language models' evaluation protocol (every position predicted once), bits per byte
The tasks themselves (language model, translation, masked LM, copy/reverse) are in qkv.tasks.
"""

from qkv.training.config import RunConfig
from qkv.training.evaluate import bits_per_byte, evaluate_loss, evaluate_sums, perplexity
from qkv.training.hooks import Hooks, StepInfo
from qkv.training.loop import fit
from qkv.training.task import Batch, Evaluation, Task, TrainResult

__all__ = [
    "Batch",
    "Evaluation",
    "Hooks",
    "RunConfig",
    "StepInfo",
    "Task",
    "TrainResult",
    "bits_per_byte",
    "evaluate_loss",
    "evaluate_sums",
    "fit",
    "perplexity",
]
