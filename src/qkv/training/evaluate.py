"""The evaluation protocol behind every val-loss figure qkv reports.

The whole split is cut into consecutive windows of the model's block size; every target
position is predicted exactly once (position 0 has no context and is never a target), and the
loss is the mean over all of them. Random-batch estimates, as nanoGPT prints, are noisier and
count some positions twice and others never.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import Tensor

from qkv.data import eval_windows

SAMPLE_PIECES = 8  # stretches of the split a partial evaluation reads


@torch.no_grad()
def evaluate_loss(
    model: Callable[[Tensor], Tensor],
    data: Tensor,
    block_size: int,
    batch_size: int = 32,
    device: torch.device | str = "cpu",
    max_tokens: int | None = None,
) -> float:
    """Mean next-token cross-entropy (nats) over `data` (or max_tokens of it, spread: see eval_batches)."""
    total_loss, total_count = 0.0, 0
    for x, y in eval_batches(data, block_size, batch_size, max_tokens):
        logits = model(x.to(device))  # (B, T, V)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), y.to(device).flatten(), reduction="sum")
        total_loss += float(loss)
        total_count += y.numel()
    return total_loss / total_count


def eval_batches(
    data: Tensor, block_size: int, batch_size: int, max_tokens: int | None = None
) -> Iterator[tuple[Tensor, Tensor]]:
    """The protocol's (x, y) batches over all of data or, for a cheaper estimate, over about max_tokens of it.

    The estimate reads SAMPLE_PIECES stretches spread evenly over the split rather than its beginning: one
    part of a text (a single play, say) can be much easier or harder than the whole.
    """
    if max_tokens is None or max_tokens >= len(data):
        return eval_windows(data, block_size, batch_size)
    pieces = max(1, min(SAMPLE_PIECES, max_tokens // (block_size + 1)))
    length = max(2, max_tokens // pieces)
    starts = torch.linspace(0, len(data) - length, pieces).long().tolist()
    return itertools.chain.from_iterable(eval_windows(data[s : s + length], block_size, batch_size) for s in starts)


def perplexity(loss: float) -> float:
    """exp(loss): the effective number of equally likely next tokens."""
    return math.exp(loss)
