"""Batches for next-token prediction: random windows for training, an exhaustive sweep for evaluation."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, TypeAlias

import torch

from qkv.errors import QkvError

Tokens: TypeAlias = Any  # a 1-D tensor of token ids, or a qkv.data.tokens.TokenSplit (sliced the same way)


def check_sizes(data: Tokens, block_size: int, batch_size: int, evaluation: bool = False) -> None:
    """Validate the shared arguments of the batch functions (one-line errors); an evaluation needs 2 tokens."""
    if data.dim() != 1:
        raise QkvError(f"expected a 1-D tensor of token ids, got shape {tuple(data.shape)}")
    if block_size < 1:
        raise QkvError(f"block size must be at least 1, got {block_size}")
    if batch_size < 1:
        raise QkvError(f"batch size must be at least 1, got {batch_size}")
    if evaluation and len(data) < 2:
        raise QkvError(f"need at least 2 tokens to evaluate (one input, one target), got {len(data)}")


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Move a CPU batch to `device`, asynchronously when it is a GPU."""
    if device.type == "cuda" and t.device.type == "cpu":
        # Pinned (page-locked) memory lets the host-to-GPU copy overlap with compute.
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def random_windows(n_windows: int, count: int, generator: torch.Generator) -> torch.Tensor:
    """`count` window numbers drawn uniformly from [0, n_windows), from the caller's generator and nowhere else:
    a run is exactly reproducible from its seed, and one draw of 2B equals two draws of B."""
    return torch.randint(n_windows, (count,), generator=generator, device=generator.device)


def random_starts(n_tokens: int, block_size: int, count: int, generator: torch.Generator) -> torch.Tensor:
    """`count` random window starts in [0, n_tokens − block_size − 1], so each window of T + 1 tokens fits.

    Drawing them from the caller's generator (and nowhere else) makes a training run exactly reproducible
    from its seed; one draw of 2B starts equals two draws of B, so micro-batches split a batch exactly.
    """
    if n_tokens < block_size + 1:
        raise QkvError(
            f"block size {block_size} is larger than the data ({n_tokens} tokens): a window needs "
            f"{block_size + 1} tokens; use a smaller block size or a longer text"
        )
    return random_windows(n_tokens - block_size, count, generator)


def windows_at(
    data: torch.Tensor, starts: torch.Tensor, block_size: int, device: torch.device | str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor]:
    """The windows at `starts`: x is (B, T) int64 tokens, y is x shifted left by one (the next tokens)."""
    # unfold gives a zero-copy (n - T, T + 1) view of all windows; indexing gathers only the B we need.
    windows = data.unfold(0, block_size + 1, 1)[starts.to(data.device)].to(torch.int64)
    x = windows[:, :-1].contiguous()
    y = windows[:, 1:].contiguous()
    device = torch.device(device)
    return to_device(x, device), to_device(y, device)


def random_batch(
    data: torch.Tensor,
    block_size: int,
    batch_size: int,
    generator: torch.Generator,
    device: torch.device | str = "cpu",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample `batch_size` random windows: x is (B, T) int64 tokens, y is x shifted left by one."""
    check_sizes(data, block_size, batch_size)
    return windows_at(data, random_starts(len(data), block_size, batch_size, generator), block_size, device)


def eval_windows(data: Tokens, block_size: int, batch_size: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Yield (x, y) batches of consecutive windows in which every target position is counted once.

    Protocol ("every position counted once"): with T = block_size, window i has inputs
    data[i*T : i*T + T] and targets data[i*T + 1 : i*T + T + 1]. The windows do not overlap, so
    each of the len(data) - 1 predictable positions 1 .. len(data) - 1 is a target exactly once.
    Full windows are stacked into batches of up to `batch_size` rows, each (rows, T) int64. When
    len(data) - 1 is not a multiple of T, the final, shorter window comes last as its own
    (1, r) batch, since it cannot be stacked with the others.

    To get the mean loss over the data, sum the per-token losses (reduction="sum") over all
    batches and divide by len(data) - 1; averaging per-batch means would over-weight the last,
    shorter batches. Windows start fresh every T tokens, so the first positions of each window
    see little context: the result is comparable between models of equal block size.

    `data` is a 1-D tensor or a memory-mapped split (qkv.data.tokens.TokenSplit); each batch is read
    when it is reached, so a split larger than memory is evaluated in constant memory.
    """
    check_sizes(data, block_size, batch_size, evaluation=True)
    # Validation happens above, eagerly; the generator below only runs when iterated.
    return (eval_batch(data, *batch) for batch in eval_plan(len(data), block_size, batch_size))


def eval_plan(n_tokens: int, block_size: int, batch_size: int) -> list[tuple[int, int, int]]:
    """eval_windows' batches over n_tokens tokens, as (first token, rows, window length) each."""
    n_full, remainder = divmod(n_tokens - 1, block_size)
    plan = [(start * block_size, min(batch_size, n_full - start), block_size) for start in range(0, n_full, batch_size)]
    if remainder:
        plan.append((n_full * block_size, 1, remainder))
    return plan


def eval_batch(data: Tokens, start: int, rows: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One batch of the plan: rows consecutive windows of `width` tokens from `start`, x (rows, width) and y."""
    tokens = data[start : start + rows * width + 1]
    x = tokens[:-1].reshape(rows, width).to(torch.int64)
    y = tokens[1:].reshape(rows, width).to(torch.int64)
    return x, y
