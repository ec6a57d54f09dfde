"""The optimiser: AdamW with weight decay on matrices only (not biases, norms, gains)."""

from __future__ import annotations

from typing import Any, Protocol

import torch
from torch import nn


class OptimizerSettings(Protocol):
    """What make_optimizer reads from a run config."""

    lr: float
    weight_decay: float
    beta1: float
    beta2: float
    fused_optimizer: bool


def make_optimizer(model: nn.Module, cfg: OptimizerSettings) -> torch.optim.AdamW:
    """AdamW, decay on matrices only; PyTorch's fused kernel where it has one and cfg.fused_optimizer asks."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    if cfg.fused_optimizer:
        try:
            return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), fused=True)
        except (RuntimeError, TypeError):
            pass  # no fused kernel for this device or dtype
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), foreach=True)


KERNELS = ("fused", "foreach")  # which implementation of AdamW a param group runs


def chosen_kernels(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """The implementation each param group of a freshly made optimizer runs (fused or foreach)."""
    return [{k: group.get(k) for k in KERNELS} for group in optimizer.param_groups]


def apply_settings(optimizer: torch.optim.Optimizer, cfg: OptimizerSettings, kernels: list[dict[str, Any]]) -> None:
    """Betas, weight decay and kernels from this run's config, over the ones a resumed state brought back."""
    decay, no_decay = optimizer.param_groups
    decay["weight_decay"], no_decay["weight_decay"] = cfg.weight_decay, 0.0
    for group, kernel in zip(optimizer.param_groups, kernels, strict=True):
        group["betas"] = (cfg.beta1, cfg.beta2)
        group.update(kernel)
