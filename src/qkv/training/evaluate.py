"""The evaluation protocol behind every val-loss figure qkv reports, on one process or shared over many.

The whole split is cut into consecutive windows of the model's block size; every target
position is predicted exactly once (position 0 has no context and is never a target), and the
loss is the mean over all of them. Random-batch estimates, as nanoGPT prints, are noisier and
count some positions twice and others never.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from qkv.data.batches import Tokens, check_sizes, eval_batch, eval_plan

if TYPE_CHECKING:
    from qkv.training.distributed import DistContext

SAMPLE_PIECES = 8  # stretches of the split a partial evaluation reads
# glibc serves blocks up to 32 MiB from its heap (with qkv.io.devices.keep_freed_memory) and maps larger ones
# fresh, so a batch whose logits are larger page-faults them in again every time.
LOGITS_BYTES = 32 * 2**20


def eval_rows(batch_size: int, block_size: int, vocab_size: int) -> int:
    """Windows per evaluation batch: batch_size, fewer where a batch's float32 logits would pass LOGITS_BYTES."""
    return max(1, min(batch_size, LOGITS_BYTES // (4 * block_size * vocab_size)))


@torch.no_grad()
def evaluate_loss(
    model: Callable[[Tensor], Tensor],
    data: Tokens,
    block_size: int,
    batch_size: int = 32,
    device: torch.device | str = "cpu",
    max_tokens: int | None = None,
    ctx: DistContext | None = None,
) -> float:
    """Mean next-token cross-entropy (nats) over `data` (or max_tokens of it, spread: see eval_batches).

    With a DistContext of several processes, rank r evaluates batches r, r + N, …; each batch's summed loss is
    put at its index in a vector that is all-reduced (x + 0 is exact) and summed in order: bit-identical to one
    process. Batches are read one at a time, so a split larger than memory is fine.
    """
    plan = eval_batches(data, block_size, batch_size, max_tokens)
    world, rank = (ctx.world_size, ctx.rank) if ctx is not None and ctx.enabled else (1, 0)
    sums = torch.zeros(len(plan), dtype=torch.float64)
    for i in range(math.ceil(len(plan) / world)):
        index = rank + i * world
        # FSDP gathers parameters collectively in every forward, so all ranks must run the same number
        # of them: a rank with no batch left re-runs batch 0 and throws the result away.
        x, y = eval_batch(data, *plan[index if index < len(plan) else 0])
        logits = model(x.to(device))  # (B, T, V)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), y.to(device).flatten(), reduction="sum")
        if index < len(plan):
            sums[index] = float(loss)
    if world > 1:
        assert ctx is not None
        sums = sums.to(ctx.device)
        dist.all_reduce(sums)
    total = 0.0
    for value in sums.tolist():
        total += value
    return total / sum(rows * width for _, rows, width in plan)


def eval_batches(data: Tokens, block_size: int, batch_size: int, max_tokens: int | None = None,
                 ) -> list[tuple[int, int, int]]:  # fmt: skip
    """The protocol's batches over all of data or, for a cheaper estimate, over about max_tokens of it, each as
    (first token, rows, window length) for qkv.data.batches.eval_batch.

    The estimate reads SAMPLE_PIECES stretches spread evenly over the split rather than its beginning: one
    part of a text (a single play, say) can be much easier or harder than the whole.
    """
    check_sizes(data, block_size, batch_size, evaluation=True)
    if max_tokens is None or max_tokens >= len(data):
        return eval_plan(len(data), block_size, batch_size)
    pieces = max(1, min(SAMPLE_PIECES, max_tokens // (block_size + 1)))
    length = max(2, max_tokens // pieces)
    starts = torch.linspace(0, len(data) - length, pieces).long().tolist()
    piece = eval_plan(length, block_size, batch_size)
    return [(s + first, rows, width) for s in starts for first, rows, width in piece]


def perplexity(loss: float) -> float:
    """exp(loss): the effective number of equally likely next tokens."""
    return math.exp(loss)
