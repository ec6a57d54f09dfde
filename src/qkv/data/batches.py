"""Batches for next-token prediction: random windows for training, an exhaustive sweep for evaluation."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from qkv.errors import QkvError


def _check_sizes(data: torch.Tensor, block_size: int, batch_size: int) -> None:
    """Validate the shared arguments of the batch functions."""
    if data.dim() != 1:
        raise QkvError(f"expected a 1-D tensor of token ids, got shape {tuple(data.shape)}")
    if block_size < 1:
        raise QkvError(f"block size must be at least 1, got {block_size}")
    if batch_size < 1:
        raise QkvError(f"batch size must be at least 1, got {batch_size}")


def _to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Move a CPU batch to `device`, asynchronously when it is a GPU."""
    if device.type == "cuda" and t.device.type == "cpu":
        # Pinned (page-locked) memory lets the host-to-GPU copy overlap with compute.
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


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
    return torch.randint(n_tokens - block_size, (count,), generator=generator, device=generator.device)


def windows_at(
    data: torch.Tensor, starts: torch.Tensor, block_size: int, device: torch.device | str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor]:
    """The windows at `starts`: x is (B, T) int64 tokens, y is x shifted left by one (the next tokens)."""
    # unfold gives a zero-copy (n - T, T + 1) view of all windows; indexing gathers only the B we need.
    windows = data.unfold(0, block_size + 1, 1)[starts.to(data.device)].to(torch.int64)
    x = windows[:, :-1].contiguous()
    y = windows[:, 1:].contiguous()
    device = torch.device(device)
    return _to_device(x, device), _to_device(y, device)


def random_batch(
    data: torch.Tensor,
    block_size: int,
    batch_size: int,
    generator: torch.Generator,
    device: torch.device | str = "cpu",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample `batch_size` random windows: x is (B, T) int64 tokens, y is x shifted left by one."""
    _check_sizes(data, block_size, batch_size)
    return windows_at(data, random_starts(len(data), block_size, batch_size, generator), block_size, device)


def eval_windows(data: torch.Tensor, block_size: int, batch_size: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
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
    """
    _check_sizes(data, block_size, batch_size)
    n = len(data)
    if n < 2:
        raise QkvError(f"need at least 2 tokens to evaluate (one input, one target), got {n}")
    # Validation happens above, eagerly; the generator below only runs when iterated.
    return _eval_windows(data, block_size, batch_size)


def _eval_windows(data: torch.Tensor, block_size: int, batch_size: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """The generator behind eval_windows (arguments already validated)."""
    n_targets = len(data) - 1
    n_full, remainder = divmod(n_targets, block_size)
    full_len = n_full * block_size
    # Reshaping the contiguous slices gives every full window at once, with no per-row loop.
    xs = data[:full_len].reshape(n_full, block_size)
    ys = data[1 : full_len + 1].reshape(n_full, block_size)
    for start in range(0, n_full, batch_size):
        rows = slice(start, start + batch_size)
        yield xs[rows].to(torch.int64), ys[rows].to(torch.int64)
    if remainder:
        x_last = data[full_len : full_len + remainder]
        y_last = data[full_len + 1 : full_len + remainder + 1]
        yield x_last.to(torch.int64).unsqueeze(0), y_last.to(torch.int64).unsqueeze(0)
