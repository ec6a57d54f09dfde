"""Preference pairs for DPO: a JSON Lines file of {"prompt", "chosen", "rejected"}, checked line by line, rendered
with the model's chat template, and batched as [chosen rows; rejected rows] with the reply's tokens as targets.

A row's prompt is a string (one user message) or a list of messages; each reply is a string (one assistant message)
or a list of messages. A row without "prompt" gives two whole conversations, and the prompt is the messages they
share (TRL's implicit prompt). Only the reply's assistant turns are trained, with their end-of-turn token, as chat
SFT masks them (qkv.chat.data.encode_reply).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from qkv.chat.data import check_message, encode_reply, end_of_turn, json_lines, json_object
from qkv.chat.examples import IGNORE, VAL_FRACTION, padded
from qkv.chat.template import ChatTemplate, Message
from qkv.errors import QkvError
from qkv.tokenizers import Tokenizer

FORMAT = '{"prompt": "…", "chosen": "…", "rejected": "…"}'


@dataclass(frozen=True)
class Preference:
    """One line of the file: the prompt's messages, the two replies' messages, and its line number."""

    prompt: list[Message]
    chosen: list[Message]
    rejected: list[Message]
    line: int


def _messages(value: Any, role: str, where: str) -> list[Message]:
    """A string as one message of `role`, or a checked list of messages."""
    if isinstance(value, str):
        return [{"role": role, "content": value}]
    if isinstance(value, list) and value:
        return [check_message(m, f"{where}, message {i + 1}") for i, m in enumerate(value)]
    raise QkvError(f"{where} is neither a string nor a list of messages; write {FORMAT}")


def parse_preference(line: str, number: int, source: str) -> Preference:
    """One JSON Lines line as a preference pair, or a one-line error naming the line and the fix."""
    where = f"{source} line {number}"
    obj = json_object(line, where, "pair", FORMAT)
    for key in ("chosen", "rejected"):
        if key not in obj:
            raise QkvError(f'{where} has no "{key}"; write one pair per line: {FORMAT}')
    chosen = _messages(obj["chosen"], "assistant", f'{where}, "chosen"')
    rejected = _messages(obj["rejected"], "assistant", f'{where}, "rejected"')
    if "prompt" in obj:
        prompt = _messages(obj["prompt"], "user", f'{where}, "prompt"')
    else:  # two whole conversations: the prompt is what they share
        shared = 0
        while shared < min(len(chosen), len(rejected)) - 1 and chosen[shared] == rejected[shared]:
            shared += 1
        prompt, chosen, rejected = chosen[:shared], chosen[shared:], rejected[shared:]
    for name, reply in (("chosen", chosen), ("rejected", rejected)):
        if not any(m["role"] == "assistant" for m in reply):
            raise QkvError(f'{where}: "{name}" has no assistant message to score; give the reply as a string or '
                           'as [{"role": "assistant", "content": …}]')  # fmt: skip
    if chosen == rejected:
        raise QkvError(f'{where}: "chosen" and "rejected" are the same reply, which teaches nothing; drop the line')
    return Preference(prompt, chosen, rejected, number)


def read_preferences(path: str | Path) -> list[Preference]:
    """Every pair of a JSON Lines file (blank lines skipped), checked."""
    found = json_lines(path, parse_preference, "preference pairs", FORMAT)
    if not found:
        raise QkvError(f"{path} holds no preference pairs; write one per line: {FORMAT}")
    return found


@dataclass
class PairBatch:
    """Chosen rows then rejected rows: inputs x (2B, T), targets y (2B, T) (IGNORE outside the replies), the
    reference model's summed log-probabilities of each reply (2B,) and each reply's length in tokens (2B,)."""

    x: Tensor
    y: Tensor
    reference: Tensor
    lengths: Tensor
    n_targets: int  # pairs: the loss is a mean over them
    n_tokens: int  # tokens read, padding excluded


@dataclass
class PairExamples:
    """Encoded pairs: row 2i is pair i's chosen sequence, row 2i + 1 its rejected one, with their reply masks."""

    ids: list[list[int]]
    masks: list[list[bool]]
    reference: Tensor | None = None  # (2N,) float64: the reference model's log-probability of each reply

    def __len__(self) -> int:
        """Number of pairs."""
        return len(self.ids) // 2

    def tokens(self) -> int:
        """Tokens in all sequences."""
        return sum(len(i) for i in self.ids)

    def rows(self, pairs: Sequence[int]) -> list[int]:
        """The sequence rows of `pairs`: every chosen one, then every rejected one."""
        return [2 * int(p) for p in pairs] + [2 * int(p) + 1 for p in pairs]

    def inputs(self, rows: Sequence[int]) -> tuple[Tensor, Tensor]:
        """Right-padded inputs (R, T) and targets (R, T) of sequence rows, the replies' tokens the only targets."""
        return padded([self.ids[r] for r in rows], [self.masks[r] for r in rows])

    def batch(self, pairs: Sequence[int], device: torch.device) -> PairBatch:
        """The pairs as one batch on device, with their reference log-probabilities."""
        assert self.reference is not None, "the reference log-probabilities are computed before training"
        rows = self.rows(pairs)
        x, y = self.inputs(rows)
        lengths = (y != IGNORE).sum(-1)
        n_tokens = sum(len(self.ids[r]) - 1 for r in rows)
        return PairBatch(x.to(device), y.to(device), self.reference[rows].to(device), lengths.to(device), len(pairs),
                         n_tokens)  # fmt: skip


@dataclass
class PairSplits:
    """Training and validation pairs, how many were dropped for not fitting the context, and the validation pairs
    kept, as they were written."""

    train: PairExamples
    val: PairExamples
    dropped: int
    val_pairs: list[Preference]


def encode_pairs(pairs: Sequence[Preference], template: ChatTemplate, tokenizer: Tokenizer,
                 block_size: int) -> PairSplits:  # fmt: skip
    """Render and tokenize every pair, drop those with a side longer than block_size + 1 tokens, and hold out the
    last tenth (at least one) for validation."""
    if len(pairs) < 2:
        raise QkvError("a preference file needs at least 2 pairs: the last tenth (at least one) is held out for "
                       "validation")  # fmt: skip
    eot = end_of_turn(tokenizer)
    encoded = [[encode_reply(template, tokenizer, p.prompt, reply, eot) for reply in (p.chosen, p.rejected)]
               for p in pairs]  # fmt: skip
    fits = [all(len(ids) <= block_size + 1 and any(mask[1:]) for ids, mask in sides) for sides in encoded]
    n_val = max(1, round(len(pairs) * VAL_FRACTION))
    parts = []
    for part in (range(len(pairs) - n_val), range(len(pairs) - n_val, len(pairs))):
        kept = [i for i in part if fits[i]]
        parts.append(PairExamples([ids for i in kept for ids, _ in encoded[i]],
                                  [mask for i in kept for _, mask in encoded[i]]))  # fmt: skip
    train, val = parts
    if len(train) == 0 or len(val) == 0:
        longest = max(len(ids) for sides in encoded for ids, _ in sides)
        which = "training" if len(train) == 0 else "validation"
        raise QkvError(f"no {which} pair fits --block-size {block_size} (the longest sequence has {longest} tokens); "
                       "raise --block-size or shorten the pairs")  # fmt: skip
    held_out = [pairs[i] for i in range(len(pairs) - n_val, len(pairs)) if fits[i]]
    return PairSplits(train, val, len(pairs) - len(train) - len(val), held_out)
