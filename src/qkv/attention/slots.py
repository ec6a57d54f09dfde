"""A KV cache of fixed slots, one per sequence, for serving many sequences at once (continuous batching).

Each slot is a row of one preallocated buffer per layer, (S, H_kv, ≥ C + 1, D), with a length of its own. Sequences
of different lengths decode together: every row writes its new key at its own length, and a padding mask hides the
columns past each row's length, so a row attends to its own tokens alone. A new sequence is admitted into a free
row between steps and reads its prompt alone in that row (prefill), while the other rows wait; a finished one frees
its row. Column C is scratch: rows that sit out a decode step write their (ignored) key there.

The attention layers see an ordinary cache: `append(k, v)` returns the keys and values to attend to, and `length`
is the number of positions before this step's tokens (qkv.attention.multi_head reads nothing else).
"""

from __future__ import annotations

import torch
from torch import Tensor

from qkv.attention.cache import KVCache, LayerCache, storage_dtype
from qkv.errors import QkvError

ALIGN = 32  # decode attends over a multiple of this many key columns (Slots.decode says why)


def aligned(n: int) -> int:
    """n rounded up to a multiple of ALIGN."""
    return -(-n // ALIGN) * ALIGN


class Slots:
    """The lengths of S sequences of at most C tokens each, and which rows the next forward pass writes."""

    def __init__(self, n_slots: int, capacity: int, device: torch.device | str = "cpu") -> None:
        if n_slots < 1 or capacity < 1:
            raise QkvError(f"a slot cache needs ≥ 1 slot of ≥ 1 token, got {n_slots} × {capacity}")
        self.n_slots, self.capacity, self.device = n_slots, capacity, torch.device(device)
        self.lengths = [0] * n_slots  # tokens each row holds
        self.row: int | None = None  # prefill: the one row being read; None: a decode step over rows [0, n)
        self.n = 0  # rows in this decode step
        self.width = 0  # key columns the next forward attends over (after its append)
        self.columns = torch.zeros(0, dtype=torch.long)  # decode: (n,) the column each row writes
        self.columns_held = aligned(capacity + 1)  # each row's buffer: C tokens, scratch, the alignment's padding

    def prefill(self, row: int, n_tokens: int) -> None:
        """Get ready to read n_tokens more of row's sequence (the row alone, a batch of 1)."""
        if self.lengths[row] + n_tokens > self.capacity:
            raise QkvError(f"slot {row} holds {self.lengths[row]} tokens; {n_tokens} more exceed its {self.capacity}")
        self.row, self.width = row, self.lengths[row] + n_tokens

    def decode(self, live: list[bool]) -> Tensor:
        """Get ready for one token in each row of [0, len(live)); rows not live write to scratch. Returns the padding
        mask (n, width): True where a row's query may look."""
        self.row, self.n = None, len(live)
        lengths = [length if on else self.capacity for length, on in zip(self.lengths, live, strict=False)]
        if any(on and length >= self.capacity for length, on in zip(self.lengths, live, strict=False)):
            raise QkvError(f"a slot is full ({self.capacity} tokens); end its sequence before another step")
        # Keys past a row's length are masked, yet the fused CPU kernel sums a row's scores in an order that depends
        # on the width; over a multiple of 32 columns it does not, so a row's numbers are the same in any batch.
        widest = 1 + max((length for length, on in zip(self.lengths, live, strict=False) if on), default=0)
        self.width = min(aligned(widest), self.columns_held)
        self.columns = torch.tensor(lengths, dtype=torch.long, device=self.device)
        visible = torch.arange(self.width, device=self.device)[None, :] <= self.columns[:, None]  # (n, width)
        return visible & torch.tensor(live, device=self.device)[:, None]

    def positions(self) -> Tensor:
        """Decode: (n, 1) the position of each row's new token (0 for rows sitting out)."""
        return torch.where(self.columns < self.capacity, self.columns, 0)[:, None]

    def advance(self, row: int, n_tokens: int) -> None:
        """Count n_tokens more in row (after a forward pass wrote them)."""
        self.lengths[row] += n_tokens

    def free(self, row: int, keep: int = 0) -> None:
        """Empty row, or keep its first `keep` tokens (a prompt that shares them reads only the rest)."""
        self.lengths[row] = min(keep, self.lengths[row])


class SlotKVCache(KVCache):
    """One attention layer's keys and values (S, H_kv, columns_held, D) for the sequences of `slots`."""

    def __init__(self, slots: Slots) -> None:
        super().__init__(slots.capacity)
        self.slots = slots

    @property
    def length(self) -> int:
        """Positions before this step's tokens: the row's length (prefill), or the widest live row's (decode)."""
        s = self.slots
        return s.lengths[s.row] if s.row is not None else s.width - 1

    @length.setter
    def length(self, value: int) -> None:
        """Lengths belong to the Slots (KVCache's constructor sets one)."""

    def append(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Write this step's (B, H_kv, T, D) keys/values at each row's length; return the keys/values to attend to."""
        if self._k is None or self._v is None:
            shape = (self.slots.n_slots, k.shape[1], self.slots.columns_held, k.shape[-1])
            self._k = k.new_zeros(shape, dtype=storage_dtype(k))
            self._v = v.new_zeros(shape, dtype=storage_dtype(v))
        s = self.slots
        if s.row is not None:  # prefill: one row, T tokens
            start = s.lengths[s.row]
            self._k[s.row, :, start : s.width] = k[0]
            self._v[s.row, :, start : s.width] = v[0]
            return self._k[s.row : s.row + 1, :, : s.width], self._v[s.row : s.row + 1, :, : s.width]
        rows = torch.arange(s.n, device=k.device)
        self._k[rows, :, s.columns] = k[:, :, 0].to(self._k.dtype)  # (n, H_kv, D) into each row's own column
        self._v[rows, :, s.columns] = v[:, :, 0].to(self._v.dtype)
        return self._k[: s.n, :, : s.width], self._v[: s.n, :, : s.width]

    def put(self, rows: list[int], k: Tensor, v: Tensor) -> None:
        """Start each of `rows` afresh with (m, H_kv, T, D) keys/values computed outside the slots (a batch of rows
        starting together); their lengths are the caller's to advance."""
        _put_rows(self, self.slots.n_slots, self.slots.columns_held, storage_dtype(k), rows, k, v)

    def nbytes(self) -> int:
        """Bytes the buffers hold (all slots, all capacity)."""
        if self._k is None or self._v is None:
            return 0
        return 2 * self._k.numel() * self._k.element_size()


class Sources:
    """Each slot's source length (encoder–decoder slots), and the source columns a decode step's cross-attention
    reads: a multiple of ALIGN, as Slots.decode reads its own keys, so the widest source does not change how the fused
    kernel sums the others'."""

    def __init__(self, slots: Slots, capacity: int) -> None:
        self.slots, self.capacity = slots, capacity
        self.lengths = [0] * slots.n_slots  # 0: the row has no source (yet)
        self.columns_held = aligned(capacity)
        self.width = 0

    def decode(self, live: list[bool]) -> Tensor:
        """The cross-attention mask (n, width) of a decode step over rows [0, len(live)): True on each live row's
        source."""
        self.width = min(aligned(max((n for n, on in zip(self.lengths, live, strict=False) if on), default=1)),
                         self.columns_held)  # fmt: skip
        lengths = torch.tensor(self.lengths[: len(live)], device=self.slots.device)
        visible = torch.arange(self.width, device=self.slots.device)[None, :] < lengths[:, None]  # (n, width)
        return visible & torch.tensor(live, device=self.slots.device)[:, None]


class SlotCrossKV(KVCache):
    """One cross-attention layer's keys and values (S, H_kv, columns_held, D) of each slot's source: put there when
    the row starts decoding (qkv.engine.rows.SourceRows), read by every decode step after."""

    def __init__(self, sources: Sources) -> None:
        super().__init__(sources.capacity)
        self.sources = sources

    @property
    def length(self) -> int:
        """The source columns a decode step reads (multi_head reads the keys here, not the memory's)."""
        return self.sources.width

    @length.setter
    def length(self, value: int) -> None:
        """Lengths belong to the Sources (KVCache's constructor sets one)."""

    def put(self, rows: list[int], k: Tensor, v: Tensor) -> None:
        """Keep the (m, H_kv, S, D) source keys/values of a batch of rows starting to decode, one row each."""
        # In the keys' own dtype, as a plain cross-attention cache keeps them.
        _put_rows(self, self.sources.slots.n_slots, self.sources.columns_held, k.dtype, rows, k, v)

    def set(self, k: Tensor, v: Tensor) -> None:
        """Refused: a slot's source keys come from put (a forward pass over the slots reads them)."""
        raise QkvError("a slot cache's source keys are put by SourceRows when its row starts decoding")

    def keys_values(self) -> tuple[Tensor, Tensor]:
        """The source keys/values of rows [0, n) of a decode step, width columns each."""
        assert self._k is not None and self._v is not None, "no slot's source keys are set"
        s = self.sources
        return self._k[: s.slots.n, :, : s.width], self._v[: s.slots.n, :, : s.width]

    def nbytes(self) -> int:
        """Bytes the buffers hold (all slots)."""
        return 0 if self._k is None else 2 * self._k.numel() * self._k.element_size()


def _put_rows(cache: KVCache, n_slots: int, columns: int, dtype: torch.dtype, rows: list[int], k: Tensor,
              v: Tensor) -> None:  # fmt: skip
    """Write (m, H_kv, T, D) keys/values at columns [0, T) of `rows`, the (n_slots, H_kv, columns, D) buffers made
    on first use."""
    if cache._k is None or cache._v is None:
        shape = (n_slots, k.shape[1], columns, k.shape[-1])
        cache._k, cache._v = k.new_zeros(shape, dtype=dtype), v.new_zeros(shape, dtype=dtype)
    cache._k[rows, :, : k.shape[-2]] = k.to(dtype)
    cache._v[rows, :, : v.shape[-2]] = v.to(dtype)


def unslottable(template: list[LayerCache]) -> int | None:
    """The first layer of `template` (a model's new_cache(1)) whose cache cannot have slots, or None: only plain KV
    caches can (a latent or a sliding-window cache keeps other things than every position's keys)."""
    return next((i for i, layer in enumerate(template) if type(layer.self_attn) is not KVCache), None)


def slot_cache(template: list[LayerCache], slots: Slots, sources: Sources | None = None) -> list[LayerCache]:
    """A slot cache with the layout of `template` (a model's new_cache(1)); only plain KV caches have slots. With
    `sources` (an encoder–decoder's), each layer's cross-attention keys have slots too."""
    i = unslottable(template)
    if i is not None:
        raise QkvError(f"layer {i} keeps a {type(template[i].self_attn).__name__}; batched generation serves models "
                       "whose layers use multi-head or grouped-query attention: use one sequence at a time "
                       "(--max-batch 1, --batch-size 1)")  # fmt: skip
    cross = [SlotCrossKV(sources) if sources is not None else KVCache() for _ in template]
    return [LayerCache(SlotKVCache(slots), c) for c in cross]


__all__ = ["ALIGN", "SlotCrossKV", "SlotKVCache", "Slots", "Sources", "aligned", "slot_cache", "unslottable"]
