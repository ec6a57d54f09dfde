"""Sequence-to-sequence batches: padded source, shifted target (teacher forcing), length buckets."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from qkv.attention.masks import padding_mask_from_ids
from qkv.tokenizers import Tokenizer


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
    n_targets: int = -1  # target tokens the loss counts (padding excluded); -1: count them here

    def __post_init__(self) -> None:
        """Count the real target tokens (one host sync, here rather than at every use)."""
        if self.n_targets < 0:
            self.n_targets = int((self.tgt_out != self.pad).sum())

    @property
    def src_mask(self) -> Tensor:
        """(B, 1, 1, S), True on real source tokens."""
        return padding_mask_from_ids(self.src, self.pad)

    @property
    def tgt_mask(self) -> Tensor:
        """(B, 1, 1, T), True on real target tokens (the causal mask is added by the decoder).

        Read off tgt_out, whose position i is real exactly when tgt_in's is: a decoder that starts with
        <pad> itself (MarianMT) must still see its start token.
        """
        return padding_mask_from_ids(self.tgt_out, self.pad)

    @property
    def n_tokens(self) -> int:
        """Target tokens read (padding excluded): what tokens/s counts for translation."""
        return self.n_targets

    def to(self, device: torch.device) -> Seq2SeqBatch:
        """The same batch on `device`."""
        return Seq2SeqBatch(self.src.to(device), self.tgt_in.to(device), self.tgt_out.to(device), self.pad,
                            self.n_targets)  # fmt: skip


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


Pairs = Sequence[tuple[Sequence[int], Sequence[int]]]


def length_buckets(pairs: Pairs, max_tokens: int, min_rows: int = 1) -> list[list[int]]:
    """Index lists of pairs of similar length with at most ~max_tokens (padded) tokens per side each.

    Sorting by length before cutting batches keeps padding (wasted compute) small; the training
    loop then draws whole buckets at random, so batches are still shuffled. A last bucket of fewer
    than min_rows pairs joins the one before it (the loop cuts a bucket into that many micro-batches).
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
    if len(buckets) > 1 and len(buckets[-1]) < min_rows:
        buckets[-2] += buckets.pop()
    return buckets


def encode_pairs(
    tokenizer: Tokenizer, pairs: Sequence[tuple[str, str]], max_len: int
) -> list[tuple[list[int], list[int]]]:
    """Token ids of (source, target) pairs, each side cut to max_len − 1 tokens (room for <s> or </s>)."""
    return [(tokenizer.encode(src)[: max_len - 1], tokenizer.encode_target(tgt)[: max_len - 1]) for src, tgt in pairs]


def batches_of(pairs: Pairs, max_tokens: int, sp: Specials) -> list[Seq2SeqBatch]:
    """Length-bucketed batches of the pairs, every pair exactly once."""
    return [
        make_batch([pairs[i][0] for i in b], [pairs[i][1] for i in b], sp) for b in length_buckets(pairs, max_tokens)
    ]
