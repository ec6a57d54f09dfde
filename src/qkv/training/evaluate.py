"""The evaluation protocol behind every val-loss figure qkv reports, on one process or shared over many.

The whole split is cut into consecutive windows of the model's block size; every target
position is predicted exactly once (position 0 has no context and is never a target), and the
loss is the mean over all of them. Random-batch estimates, as nanoGPT prints, are noisier and
count some positions twice and others never.

Bits per byte reads the same windows: the summed loss in bits over the UTF-8 bytes of the tokens predicted, a
figure that does not depend on how the text was cut into tokens (characters, a BPE, SmolLM2's vocabulary).
Special tokens are not text: neither their loss nor their (zero) bytes count.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from qkv.data.batches import Tokens, check_sizes, eval_batch, eval_plan
from qkv.errors import QkvError

if TYPE_CHECKING:
    from qkv.tokenizers import Tokenizer
    from qkv.training.distributed import DistContext

SAMPLE_PIECES = 8  # stretches of the split a partial evaluation reads
# glibc serves blocks up to 32 MiB from its heap (with qkv.io.devices.keep_freed_memory) and maps larger ones
# fresh, so a batch whose logits are larger page-faults them in again every time.
LOGITS_BYTES = 32 * 2**20


def eval_rows(batch_size: int, block_size: int, vocab_size: int) -> int:
    """Windows per evaluation batch: batch_size, fewer where a batch's float32 logits would pass LOGITS_BYTES."""
    return max(1, min(batch_size, LOGITS_BYTES // (4 * block_size * vocab_size)))


@dataclass(frozen=True)
class LossSums:
    """An evaluation's sums: nats over every target and, given token_bytes, nats and UTF-8 bytes over the text."""

    loss: float  # nats, summed over every target position
    targets: int  # target positions predicted
    text_loss: float = 0.0  # nats over the targets that are text (special tokens left out)
    text_bytes: int = 0  # UTF-8 bytes of the targets' text

    @property
    def mean(self) -> float:
        """Mean next-token cross-entropy (nats): the validation loss."""
        return self.loss / self.targets

    def bits_per_byte(self) -> float:
        """The text's nats in bits, per byte of it."""
        return bits_per_byte(self.text_loss, self.text_bytes)


def evaluate_loss(
    model: Callable[[Tensor], Tensor],
    data: Tokens,
    block_size: int,
    batch_size: int = 32,
    device: torch.device | str = "cpu",
    max_tokens: int | None = None,
    ctx: DistContext | None = None,
) -> float:
    """Mean next-token cross-entropy (nats) over `data` (or max_tokens of it, spread: see eval_batches)."""
    return evaluate_sums(model, data, block_size, batch_size, device, max_tokens, ctx).mean


@torch.no_grad()
def evaluate_sums(
    model: Callable[[Tensor], Tensor],
    data: Tokens,
    block_size: int,
    batch_size: int = 32,
    device: torch.device | str = "cpu",
    max_tokens: int | None = None,
    ctx: DistContext | None = None,
    token_bytes: Tensor | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> LossSums:
    """evaluate_loss's sums; with token_bytes (each id's UTF-8 bytes, 0 for special tokens), also bits per byte's.

    With a DistContext of several processes, rank r evaluates batches r, r + N, …; each batch's sums are put
    at its index in a matrix that is all-reduced (x + 0 is exact) and summed in order: bit-identical to one
    process. Batches are read one at a time, so a split larger than memory is fine. progress: called with (batches
    done, batches in all) after each batch.
    """
    plan = eval_batches(data, block_size, batch_size, max_tokens)
    world, rank = (ctx.world_size, ctx.rank) if ctx is not None and ctx.enabled else (1, 0)
    sizes = None if token_bytes is None else token_bytes.to(device)
    sums = torch.zeros(len(plan), 3, dtype=torch.float64)  # per batch: nats, nats of special targets, bytes
    for i in range(math.ceil(len(plan) / world)):
        index = rank + i * world
        # FSDP gathers parameters collectively in every forward, so all ranks must run the same number
        # of them: a rank with no batch left re-runs batch 0 and throws the result away.
        x, y = eval_batch(data, *plan[index if index < len(plan) else 0])
        logits = model(x.to(device)).flatten(0, 1).float()  # (B·T, V)
        targets = y.to(device).flatten()
        loss = F.cross_entropy(logits, targets, reduction="sum")
        if progress is not None:
            progress(min(index + 1, len(plan)) if world == 1 else i + 1, math.ceil(len(plan) / world))
        if index >= len(plan):
            continue
        sums[index, 0] = float(loss)
        if sizes is not None:
            target_bytes = sizes[targets]
            # The loss is summed over every target as before (the validation loss keeps its digits); the special
            # targets' share, taken from those few rows alone, is what bits per byte leaves out.
            specials = (target_bytes == 0).nonzero().flatten()
            if len(specials):
                sums[index, 1] = float(F.cross_entropy(logits[specials], targets[specials], reduction="sum"))
            sums[index, 2] = float(target_bytes.sum())
    if world > 1:
        assert ctx is not None
        sums = sums.to(ctx.device)
        dist.all_reduce(sums)
    total = special = 0.0
    for nats, special_nats, _ in sums.tolist():
        total += nats
        special += special_nats
    n_bytes = int(sums[:, 2].sum()) if sizes is not None else 0
    return LossSums(total, sum(rows * width for _, rows, width in plan), total - special, n_bytes)


def bits_per_byte(loss_sum_nats: float, n_bytes: int) -> float:
    """Summed cross-entropy in nats → bits per byte of the text predicted: nats / ln 2 / bytes."""
    if n_bytes <= 0:
        raise QkvError("bits per byte needs text among the predicted tokens, and they hold no bytes")
    return loss_sum_nats / math.log(2) / n_bytes


def token_bytes_of(tokenizer: Tokenizer) -> Tensor | None:
    """The tokenizer's token_bytes as an int64 tensor, or None for a tokenizer that cannot say them."""
    try:
        return torch.tensor(tokenizer.token_bytes(), dtype=torch.int64)
    except QkvError:
        return None


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
