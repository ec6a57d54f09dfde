"""Where the engine's sequences keep their keys and values: the rows it reads prompts into and decodes together.

Two layouts behind one interface:
- SlotRows: S rows of one slot cache (qkv.attention.slots); each decode step is one forward pass over every
  decoding row, each at its own position, compiled if asked (qkv.generation.compiled_step). Plain multi-head and
  grouped-query caches only.
- OneRow: a single sequence in the model's own cache (any attention: latent, sliding window), stepped as
  qkv.generation.stream steps it (the same chunks, the same one-token step, compiled if asked), so its tokens are
  stream's.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import Tensor

from qkv.attention import LayerCache, crop_cache, settled_length
from qkv.attention.slots import Slots, slot_cache, unslottable
from qkv.generation import compiled_step
from qkv.models import DecoderLM

FIRST_CAPACITY = 1024  # OneRow's first cache: a long context's whole buffer would be allocated for a short chat


class Rows(Protocol):
    """The engine's view of its cache: rows of at most `capacity` tokens, read in chunks and decoded together."""

    capacity: int

    def length(self, row: int) -> int: ...
    def keep(self, row: int, n: int) -> int: ...
    def prefill(self, row: int, ids: Tensor, last: bool) -> Tensor | None: ...
    def decode(self, live: list[bool], ids: Tensor) -> Tensor: ...


def together(model: DecoderLM, n: int) -> int:
    """How many of n sequences decode together: n, or 1 for a model whose caches have no slots."""
    return n if n > 1 and unslottable(model.new_cache(1)) is None else 1


class SlotRows:
    """n_rows sequences of up to `capacity` tokens in one slot cache, decoded in one forward pass per step."""

    def __init__(self, model: DecoderLM, n_rows: int, capacity: int, device: torch.device,
                 compiled: bool = False) -> None:  # fmt: skip
        self.model, self.capacity = model, capacity
        self.slots = Slots(n_rows, capacity, device)
        self.cache = slot_cache(model.new_cache(1), self.slots)
        self.step = compiled_step(model) if compiled else model.next_logits  # the decode step; prompts stay eager

    def length(self, row: int) -> int:
        """Tokens the row holds."""
        return self.slots.lengths[row]

    def keep(self, row: int, n: int) -> int:
        """Keep the row's first n tokens (0: empty it); returns how many it holds."""
        self.slots.free(row, n)
        return self.slots.lengths[row]

    def prefill(self, row: int, ids: Tensor, last: bool) -> Tensor | None:
        """Read ids (1, T) into the row; the next token's logits (V,) if `last`, else None."""
        self.slots.prefill(row, ids.shape[1])
        logits = self.model.next_logits(ids, self.cache)[0] if last else self.model.hidden(ids, self.cache)
        self.slots.advance(row, ids.shape[1])
        return logits if last else None

    def decode(self, live: list[bool], ids: Tensor) -> Tensor:
        """One token (n, 1) into rows [0, n), live ones only; their next tokens' logits (n, V)."""
        mask = self.slots.decode(live)  # (n, width)
        logits = self.step(ids, self.cache, mask, self.slots.positions())  # (n, V)
        for row, on in enumerate(live):
            if on:
                self.slots.advance(row, 1)
        return logits


class OneRow:
    """One sequence in the model's own cache; its one-token step compiled (qkv.generation.compiled_step) if asked."""

    def __init__(self, model: DecoderLM, capacity: int, compiled: bool = False) -> None:
        self.model, self.capacity = model, capacity
        self.cache: list[LayerCache] = model.new_cache(min(capacity, FIRST_CAPACITY))  # it doubles as it fills
        self.step = compiled_step(model) if compiled else None

    def length(self, row: int) -> int:
        """Tokens the sequence holds (every layer: a step stopped midway, by Ctrl-C, is undone)."""
        return settled_length(self.cache)

    def keep(self, row: int, n: int) -> int:
        """Keep the first n tokens, or fewer where the cache cannot (a sliding window's dropped keys); returns how
        many it holds."""
        crop_cache(self.cache, n)
        return settled_length(self.cache)

    def prefill(self, row: int, ids: Tensor, last: bool) -> Tensor | None:
        """Read ids (1, T); the next token's logits (V,) if `last`, else None (one last token: the decode step)."""
        if last:
            return self.decode([True], ids)[0] if ids.shape[1] == 1 else self.model.next_logits(ids, self.cache)[0]
        self.model.hidden(ids, self.cache)
        return None

    def decode(self, live: list[bool], ids: Tensor) -> Tensor:
        """One token (1, 1); the next token's logits (1, V)."""
        return self.step(ids, self.cache) if self.step is not None else self.model.next_logits(ids, self.cache)


def rows_for(model: DecoderLM, n_rows: int, capacity: int, compiled: bool = False) -> Rows:
    """OneRow for one sequence (any model), else SlotRows (plain KV caches only); the decode step compiled if
    asked."""
    if n_rows == 1:
        return OneRow(model, capacity, compiled)
    return SlotRows(model, n_rows, capacity, next(model.parameters()).device, compiled)


__all__ = ["OneRow", "Rows", "SlotRows", "rows_for", "together"]
