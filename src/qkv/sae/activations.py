"""The activations an SAE trains on: a language model's activation at one named hook, over prepared token shards,
served in shuffled batches from a bounded buffer.

The model runs only as far as the hook (a forward hook stops it there), on random windows of the shards. Positions
that would teach the SAE little are dropped, and the choice is saved with the run:
- the first position of each window, whose stream is the attention sink's (of a far larger norm than the others');
- the tokenizer's BOS token wherever it appears;
- any position whose norm is above max_norm_ratio × the median norm of the windows read with it (8 at a time).

The stream is a pure function of (seed, position): buffer r is filled from windows drawn by a generator seeded with
(seed, r), exactly `buffer_tokens` rows kept, and shuffled by the same generator. A resumed run starting at step s
refills buffer ⌊s·B / buffer_tokens⌋ and carries on from its offset: it reads what the uninterrupted run read. Memory
does not grow with the number of tokens trained on: a buffer held, and the next one while it is filled, and the heap
pages freed in between are given back to the OS at each new buffer.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor, nn

from qkv.data.batches import random_windows
from qkv.data.tokens import TokenSplit
from qkv.errors import QkvError
from qkv.interpret.hooks import hooked
from qkv.io.devices import release_freed_memory


class _Reached(Exception):
    """Raised by the hook once the activation is read: the rest of the forward pass is not needed."""


def read_activation(model: nn.Module, hook: str, ids: Tensor) -> Tensor:
    """(B, T, d) the activation named `hook` for token ids (B, T), the model run only as far as the hook."""
    box: dict[str, Tensor] = {}

    def take(x: Tensor) -> Tensor:
        box["x"] = x.detach()
        raise _Reached

    with torch.no_grad(), hooked(model, patch={hook: take}), contextlib.suppress(_Reached):
        model(ids)
    if "x" not in box:
        raise QkvError(f"the forward pass never reached {hook}")
    return box["x"]


@dataclass(frozen=True)
class Filters:
    """Which positions are dropped before the SAE sees them."""

    drop_first: bool = True  # each window's first position (the attention sink)
    bos_id: int | None = None  # the tokenizer's BOS token, wherever it is
    max_norm_ratio: float | None = 10.0  # norms above this × the batch's median (None: keep all)

    def mask(self, ids: Tensor, acts: Tensor) -> Tensor:
        """(B, T) bool: the positions of activations (B, T, d) of ids (B, T) that are kept."""
        mask = torch.ones(ids.shape, dtype=torch.bool, device=acts.device)
        if self.drop_first:
            mask[:, 0] = False
        if self.bos_id is not None:
            mask &= ids.to(acts.device) != self.bos_id
        if self.max_norm_ratio is not None and bool(mask.any()):
            norms = acts.norm(dim=-1)  # (B, T)
            mask &= norms <= self.max_norm_ratio * norms[mask].median()
        return mask


class Buffered(ABC):
    """Rows at any position of a sequence kept as numbered buffers of buffer_tokens rows each, one held at a time."""

    buffer_tokens: int
    _held: tuple[int, Tensor] | None = None  # (index, rows) of the buffer held

    @abstractmethod
    def load(self, index: int) -> Tensor:
        """(buffer_tokens, d) buffer `index`, made or read anew."""

    def buffer(self, index: int) -> Tensor:
        """Buffer `index`: the one held, or loaded (the one held is let go first, so that one is in memory)."""
        if self._held is None or self._held[0] != index:
            self._held = None
            # Training keeps freed heap memory for reuse (keep_freed_memory); AuxK's steps free it in pieces that the
            # next steps do not fit back exactly, so without this the heap would grow with every buffer trained on.
            release_freed_memory()
            self._held = index, self.load(index)
        return self._held[1]

    def rows(self, start: int, count: int) -> Tensor:
        """(count, d) rows start … start + count − 1 (copies: no view keeps a buffer alive)."""
        parts = []
        while count > 0:
            index, offset = divmod(start, self.buffer_tokens)
            take = min(count, self.buffer_tokens - offset)
            parts.append(self.buffer(index)[offset : offset + take].clone())
            start, count = start + take, count - take
        return torch.cat(parts)


class ActivationStream(Buffered):
    """Shuffled rows of activations at any position of an endless, reproducible stream (module docstring)."""

    def __init__(self, model: nn.Module, hook: str, split: TokenSplit, block_size: int, filters: Filters,
                 buffer_tokens: int, seed: int, windows_per_pass: int = 8) -> None:  # fmt: skip
        if split.window_count(block_size) < 1:
            raise QkvError(f"no window of {block_size + 1} tokens fits in the data; lower --block-size")
        self.model, self.hook, self.split, self.block_size = model, hook, split, block_size
        self.filters, self.buffer_tokens, self.seed = filters, buffer_tokens, seed
        self.windows_per_pass = windows_per_pass

    def load(self, index: int) -> Tensor:
        """Buffer `index`: rows of random windows until buffer_tokens are kept, then shuffled."""
        # Both numbers mixed into one 32-bit seed (a torch CPU generator keeps only a seed's low 32 bits).
        mixed = np.random.SeedSequence([self.seed % 2**63, index]).generate_state(1)[0]
        generator = torch.Generator().manual_seed(int(mixed))
        n_windows = self.split.window_count(self.block_size)
        kept: list[Tensor] = []
        total = 0
        while total < self.buffer_tokens:
            starts = random_windows(n_windows, self.windows_per_pass, generator)
            ids, _ = self.split.windows(starts, self.block_size)
            device = next(self.model.parameters()).device
            acts = read_activation(self.model, self.hook, ids.to(device)).float().cpu()
            rows = acts[self.filters.mask(ids, acts)]
            kept.append(rows)
            total += len(rows)
        rows = torch.cat(kept)[: self.buffer_tokens]
        del kept
        return rows[torch.randperm(len(rows), generator=generator)]


def geometric_median(points: Tensor, iterations: int = 50, tolerance: float = 1e-5) -> Tensor:
    """(d,) the point with the least summed distance to points (N, d): Weiszfeld's iterations from the mean.
    b_dec starts there, as in Anthropic's 2023 SAEs (SAELens 6 starts it at zero): a centre outliers move little."""
    guess = points.mean(0)
    for _ in range(iterations):
        weights = 1 / (points - guess).norm(dim=-1).clamp_min(1e-8)  # (N,)
        new = (weights[:, None] * points).sum(0) / weights.sum()
        if (new - guess).norm() <= tolerance * guess.norm().clamp_min(1e-8):
            return new
        guess = new
    return guess
