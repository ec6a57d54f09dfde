"""Sequence-to-sequence batches: padded source, shifted target (teacher forcing), length buckets."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from qkv.attention.masks import padding_mask_from_ids


@dataclass(frozen=True)
class Specials:
    """Ids of the special tokens every sequence-to-sequence vocabulary here has."""

    pad: int = 0
    bos: int = 1
    eos: int = 2


@dataclass
class Seq2SeqBatch:
    """src (B, S) = x + </s>; tgt_in (B, T) = <s> + y; tgt_out (B, T) = y + </s>; all padded with pad."""

    src: Tensor
    tgt_in: Tensor
    tgt_out: Tensor
    pad: int

    @property
    def src_mask(self) -> Tensor:
        """(B, 1, 1, S), True on real source tokens."""
        return padding_mask_from_ids(self.src, self.pad)

    @property
    def tgt_mask(self) -> Tensor:
        """(B, 1, 1, T), True on real target tokens (the causal mask is added by the decoder)."""
        return padding_mask_from_ids(self.tgt_in, self.pad)

    @property
    def n_tokens(self) -> int:
        """Target tokens that the loss counts (padding excluded)."""
        return int((self.tgt_out != self.pad).sum())

    def to(self, device: torch.device) -> Seq2SeqBatch:
        """The same batch on `device`."""
        return Seq2SeqBatch(self.src.to(device), self.tgt_in.to(device), self.tgt_out.to(device), self.pad)


def pad_sequences(seqs: Sequence[Sequence[int]], pad: int) -> Tensor:
    """(B, max_len) int64 tensor of the sequences, right-padded."""
    out = torch.full((len(seqs), max(len(s) for s in seqs)), pad, dtype=torch.int64)
    for row, seq in enumerate(seqs):
        out[row, : len(seq)] = torch.as_tensor(list(seq), dtype=torch.int64)
    return out


def source_tensor(sources: Sequence[Sequence[int]], sp: Specials) -> Tensor:
    """(B, S) source ids, each sentence followed by </s>, right-padded."""
    return pad_sequences([[*s, sp.eos] for s in sources], sp.pad)


def make_batch(sources: Sequence[Sequence[int]], targets: Sequence[Sequence[int]], sp: Specials) -> Seq2SeqBatch:
    """A teacher-forcing batch: the decoder reads <s> y₁ … y_n and must predict y₁ … y_n </s>."""
    tgt_in = pad_sequences([[sp.bos, *t] for t in targets], sp.pad)
    tgt_out = pad_sequences([[*t, sp.eos] for t in targets], sp.pad)
    return Seq2SeqBatch(source_tensor(sources, sp), tgt_in, tgt_out, sp.pad)


def length_buckets(pairs: Sequence[tuple[Sequence[int], Sequence[int]]], max_tokens: int) -> list[list[int]]:
    """Index lists of pairs of similar length with at most ~max_tokens (padded) tokens per side each.

    Sorting by length before cutting batches keeps padding (wasted compute) small; the training
    loop then draws whole buckets at random, so batches are still shuffled.
    """
    order = sorted(range(len(pairs)), key=lambda i: (len(pairs[i][1]), len(pairs[i][0]), i))
    buckets: list[list[int]] = []
    current: list[int] = []
    longest = 0  # the longest side (+ </s> or <s>) in the current bucket
    for i in order:
        need = max(len(pairs[i][0]), len(pairs[i][1])) + 1
        if current and max(longest, need) * (len(current) + 1) > max_tokens:
            buckets.append(current)
            current, longest = [], 0
        current.append(i)
        longest = max(longest, need)
    if current:
        buckets.append(current)
    return buckets
