"""Pieces shared by the training loops (language model, translation): optimiser, metrics log, Ctrl-C."""

from __future__ import annotations

import contextlib
import json
import signal
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from qkv.training.checkpoint import atomic_write_bytes
from qkv.training.run import METRICS_FILE


class OptimizerSettings(Protocol):
    """What make_optimizer reads from a training config."""

    lr: float
    weight_decay: float
    beta1: float
    beta2: float


def make_optimizer(model: nn.Module, cfg: OptimizerSettings) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only (not biases, norms); fused where PyTorch has it."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    try:
        return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), fused=True)
    except (RuntimeError, TypeError):
        return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), foreach=True)


def read_metrics(run_dir: Path, up_to_step: int) -> list[dict[str, Any]]:
    """metrics.jsonl entries logged at or before a step (a killed run may have logged past its checkpoint)."""
    path = run_dir / METRICS_FILE
    if not path.is_file():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in rows if r["step"] <= up_to_step]


def write_metrics(run_dir: Path, metrics: list[dict[str, Any]]) -> None:
    """Rewrite metrics.jsonl atomically (it is small: one line per evaluation)."""
    atomic_write_bytes(run_dir / METRICS_FILE, "".join(json.dumps(m) + "\n" for m in metrics).encode())


@contextlib.contextmanager
def deferred_interrupt() -> Iterator[Callable[[], bool]]:
    """Turn the first Ctrl-C into a request that the loop honours between steps; a second one stops at once.

    A KeyboardInterrupt raised at an arbitrary point could land inside backward() or between the
    optimizer's updates of moments and weights, and the checkpoint saved after it would hold a
    half-taken step. Only the main thread can install signal handlers; elsewhere nothing changes.
    """
    requested = False

    def handler(signum: int, frame: Any) -> None:
        nonlocal requested
        if requested:  # impatient second Ctrl-C: give up on a clean stop
            signal.signal(signal.SIGINT, signal.default_int_handler)
            raise KeyboardInterrupt
        requested = True

    if threading.current_thread() is not threading.main_thread():
        yield lambda: False
        return
    previous = signal.signal(signal.SIGINT, handler)
    try:
        yield lambda: requested
    finally:
        signal.signal(signal.SIGINT, previous)
