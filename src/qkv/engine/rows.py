"""Where the engine's sequences keep their keys and values: the rows it reads prompts into and decodes together.

Two layouts behind one interface:
- SlotRows: S rows of one slot cache (qkv.attention.slots); each decode step is one forward pass over every
  decoding row, each at its own position, compiled if asked (qkv.generation.compiled_step). Plain multi-head and
  grouped-query caches only.
- OneRow: a single sequence in the model's own cache (any attention: latent, sliding window), stepped as
  qkv.generation.stream steps it (the same chunks, the same one-token step, compiled if asked), so its tokens are
  stream's.
- SourceRows: an encoder–decoder's rows: the prompt is a source sentence, encoded once when it is all read; its
  cross-attention keys stay in the row's slot, and the decoder starts from the model's start token.
"""

from __future__ import annotations

from typing import Protocol, cast

import torch
from torch import Tensor

from qkv.attention import LayerCache, crop_cache, settled_length
from qkv.attention.slots import SlotCrossKV, SlotKVCache, Slots, Sources, slot_cache, unslottable
from qkv.generation import compiled_step
from qkv.models import DecoderLM, Transformer

FIRST_CAPACITY = 1024  # OneRow's first cache: a long context's whole buffer would be allocated for a short chat


Read = tuple[int, Tensor, bool]  # a row, the prompt ids (1, T) it reads next, and whether they end its prompt


class Rows(Protocol):
    """The engine's view of its cache: rows of at most `capacity` tokens, read in chunks and decoded together."""

    capacity: int
    n_rows: int
    prompt_tokens: int  # the longest prompt a row reads (a sliding prompt past it: its end)
    prompt_vocab: int | None  # prompt ids are refused outside [0, prompt_vocab)

    def length(self, row: int) -> int: ...
    def keep(self, row: int, n: int) -> int: ...
    def prefill(self, reads: list[Read]) -> list[Tensor | None]: ...
    def decode(self, live: list[bool], ids: Tensor) -> Tensor: ...


def together(model: DecoderLM, n: int) -> int:
    """How many of n sequences decode together: n, or 1 for a model whose caches have no slots."""
    return n if n > 1 and unslottable(model.new_cache(1)) is None else 1


class SlotRows:
    """n_rows sequences of up to `capacity` tokens in one slot cache, decoded in one forward pass per step."""

    def __init__(self, model: DecoderLM, n_rows: int, capacity: int, device: torch.device,
                 compiled: bool = False) -> None:  # fmt: skip
        self.model, self.capacity, self.n_rows = model, capacity, n_rows
        self.prompt_tokens, self.prompt_vocab = capacity - 1, model.cfg.vocab_size  # room for one reply token
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

    def prefill(self, reads: list[Read]) -> list[Tensor | None]:
        """Read each row's ids, one row after another (a row's numbers as if it were alone); for each read that
        ends its prompt, the next token's logits (V,), else None."""
        return [self._prefill(*read) for read in reads]

    def _prefill(self, row: int, ids: Tensor, last: bool) -> Tensor | None:
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
        self.model, self.capacity, self.n_rows = model, capacity, 1
        self.prompt_tokens, self.prompt_vocab = capacity - 1, model.cfg.vocab_size
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

    def prefill(self, reads: list[Read]) -> list[Tensor | None]:
        """Read the sequence's ids (one read at a time: there is one row)."""
        return [self._prefill(ids, last) for _, ids, last in reads]

    def _prefill(self, ids: Tensor, last: bool) -> Tensor | None:
        """Read ids (1, T); the next token's logits (V,) if `last`, else None (one last token: the decode step)."""
        if last:
            return self.decode([True], ids)[0] if ids.shape[1] == 1 else self.model.next_logits(ids, self.cache)[0]
        self.model.hidden(ids, self.cache)
        return None

    def decode(self, live: list[bool], ids: Tensor) -> Tensor:
        """One token (1, 1); the next token's logits (1, V)."""
        return self.step(ids, self.cache) if self.step is not None else self.model.next_logits(ids, self.cache)


class SourceRows:
    """n_rows translations at once: each row's source is encoded when it is all read, its cross-attention keys kept
    in the row's slot; target tokens (from `start`, never `pad`) decode together as SlotRows' do."""

    def __init__(self, model: Transformer, n_rows: int, capacity: int, source_tokens: int, start: int, pad: int,
                 ) -> None:  # fmt: skip
        """capacity: target tokens a row holds (its start token included); source_tokens: the longest source."""
        self.model, self.capacity, self.n_rows, self.start, self.pad = model, capacity, n_rows, start, pad
        self.prompt_tokens, self.prompt_vocab = source_tokens, model.cfg.src_vocab_size
        self.slots = Slots(n_rows, capacity, next(model.parameters()).device)
        self.sources = Sources(self.slots, source_tokens)
        self.cache = slot_cache(model.new_cache(1), self.slots, self.sources)
        self.read: list[list[int]] = [[] for _ in range(n_rows)]  # each row's source so far

    def length(self, row: int) -> int:
        """Target tokens the row holds."""
        return self.slots.lengths[row]

    def keep(self, row: int, n: int) -> int:
        """Empty the row (another source shares nothing with this one's keys); returns 0."""
        self.slots.free(row, 0)
        self.sources.lengths[row], self.read[row] = 0, []
        return 0

    def prefill(self, reads: list[Read]) -> list[Tensor | None]:
        """Read source ids (1, T) into each row; the sources that are whole are encoded together and start decoding
        (the first target token's logits (V,)), the others wait for their next chunk (None)."""
        for row, ids, _ in reads:
            self.read[row] += ids[0].tolist()
        starting = [row for row, _, last in reads if last]
        first = dict(zip(starting, self._start(starting), strict=True)) if starting else {}
        return [first.get(row) for row, _, _ in reads]

    def _start(self, rows: list[int]) -> Tensor:
        """Encode the rows' sources as one batch, decode the start token after each, and keep the keys that makes
        in the rows' slots; the first target tokens' logits (m, V)."""
        lengths = torch.tensor([len(self.read[row]) for row in rows])
        src = torch.full((len(rows), int(lengths.max())), self.pad)  # (m, S), padded to the longest
        for i, row in enumerate(rows):
            src[i, : lengths[i]] = torch.tensor(self.read[row])
        device = self.slots.device
        src, keep = src.to(device), (torch.arange(src.shape[1])[None, :] < lengths[:, None]).to(device)
        src_mask = keep[:, None, None, :]  # (m, 1, 1, S): each source's own tokens
        memory = self.model.encode(src, src_mask)  # (m, S, d_model)
        cache = self.model.new_cache(1)  # a plain cache for this batch, copied into the slots after
        start = torch.full((len(rows), 1), self.start, device=device)
        logits = self.model.decode(start, memory, src_mask, cache=cache)[:, -1]  # (m, V)
        for layer, slot in zip(cache, self.cache, strict=True):
            cast(SlotKVCache, slot.self_attn).put(rows, *layer.self_attn.keys_values())
            cast(SlotCrossKV, slot.cross_attn).put(rows, *layer.cross_attn.keys_values())
        for row, n in zip(rows, lengths.tolist(), strict=True):
            self.slots.advance(row, 1)
            self.sources.lengths[row] = n
        return self._no_pad(logits)

    def decode(self, live: list[bool], ids: Tensor) -> Tensor:
        """One target token (n, 1) into rows [0, n), live ones only; their next tokens' logits (n, V)."""
        mask = self.slots.decode(live)[:, None, None, :]  # (n, 1, 1, width)
        src_mask = self.sources.decode(live)[:, None, None, :]  # (n, 1, 1, source width)
        # Cross-attention reads each row's source keys from its slot; the memory itself is not read again.
        memory = ids.new_empty(len(live), 0, self.model.cfg.d_model, dtype=torch.float32)
        logits = self.model.decode(ids, memory, src_mask, mask, self.cache, self.slots.positions())[:, -1]
        for row, on in enumerate(live):
            if on:
                self.slots.advance(row, 1)
        return self._no_pad(logits)

    def _no_pad(self, logits: Tensor) -> Tensor:
        """Padding is never a next token (log P of the others unchanged, as transformers' bad_words_ids)."""
        logits = logits.float().log_softmax(-1)
        logits[..., self.pad] = -torch.inf
        return logits


def rows_for(model: DecoderLM, n_rows: int, capacity: int, compiled: bool = False) -> Rows:
    """OneRow for one sequence (any model), else SlotRows (plain KV caches only); the decode step compiled if
    asked."""
    if n_rows == 1:
        return OneRow(model, capacity, compiled)
    return SlotRows(model, n_rows, capacity, next(model.parameters()).device, compiled)


__all__ = ["OneRow", "Read", "Rows", "SlotRows", "SourceRows", "rows_for", "together"]
