"""The evaluation protocol behind every val-loss figure qkv reports.

The whole split is cut into consecutive windows of the model's block size; every target
position is predicted exactly once (position 0 has no context and is never a target), and the
loss is the mean over all of them. Random-batch estimates, as nanoGPT prints, are noisier and
count some positions twice and others never.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from qkv.data import eval_windows


@torch.no_grad()
def evaluate_loss(
    model: Callable[[Tensor], Tensor],
    data: Tensor,
    block_size: int,
    batch_size: int = 32,
    device: torch.device | str = "cpu",
    max_tokens: int | None = None,
) -> float:
    """Mean next-token cross-entropy (nats) over `data` (or its first max_tokens tokens)."""
    if max_tokens is not None:
        data = data[:max_tokens]
    total_loss, total_count = 0.0, 0
    for x, y in eval_windows(data, block_size, batch_size):
        logits = model(x.to(device))  # (B, T, V)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), y.to(device).flatten(), reduction="sum")
        total_loss += float(loss)
        total_count += y.numel()
    return total_loss / total_count


def perplexity(loss: float) -> float:
    """exp(loss): the effective number of equally likely next tokens."""
    return math.exp(loss)
