"""Tokenized conversations as training examples: one conversation per row, padded on the right, with the tokens
the loss ignores (everything but the assistant's turns, and the padding) marked by IGNORE in the targets."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from qkv.chat.data import Conversation, encode_chat, end_of_turn
from qkv.chat.template import ChatTemplate
from qkv.errors import QkvError
from qkv.tokenizers import Tokenizer

IGNORE = -100  # cross_entropy's ignore_index: a position that is not a target
VAL_FRACTION = 0.1  # the last tenth of the conversations, as a text file's last tenth of characters


@dataclass
class ChatBatch:
    """Inputs x (B, T) and next tokens y (B, T), IGNORE where the loss does not count."""

    x: Tensor
    y: Tensor
    n_targets: int  # positions the loss counts: the assistant's tokens
    n_tokens: int  # tokens read, padding excluded


def padded(ids: Sequence[Sequence[int]], masks: Sequence[Sequence[bool]]) -> tuple[Tensor, Tensor]:
    """Sequences as right-padded inputs x (R, T) and next tokens y (R, T), IGNORE where a token's mask is off or
    where there is only padding (causal attention: padding is never attended)."""
    width = max(len(i) for i in ids) - 1
    x = torch.zeros(len(ids), width, dtype=torch.int64)
    y = torch.full((len(ids), width), IGNORE, dtype=torch.int64)
    for r, (row, mask) in enumerate(zip(ids, masks, strict=True)):
        tokens, trained = torch.tensor(row), torch.tensor(mask)
        n = len(tokens) - 1
        x[r, :n] = tokens[:-1]
        y[r, :n] = tokens[1:].masked_fill(~trained[1:], IGNORE)  # the target at t is token t + 1
    return x, y


@dataclass
class ChatExamples:
    """Encoded conversations: each one's token ids and loss mask."""

    ids: list[list[int]]
    masks: list[list[bool]]

    def __len__(self) -> int:
        """Number of conversations."""
        return len(self.ids)

    def tokens(self) -> int:
        """Tokens in all conversations."""
        return sum(len(i) for i in self.ids)

    def trained(self) -> int:
        """Tokens the loss trains on."""
        return sum(sum(m) for m in self.masks)

    def batch(self, indices: Sequence[int], device: torch.device) -> ChatBatch:
        """The conversations at `indices` as one right-padded batch (causal attention: padding is never attended)."""
        rows = [int(i) for i in indices]
        x, y = padded([self.ids[i] for i in rows], [self.masks[i] for i in rows])
        n_targets = int((y != IGNORE).sum())
        n_tokens = sum(len(self.ids[i]) - 1 for i in rows)
        return ChatBatch(x.to(device, non_blocking=True), y.to(device, non_blocking=True), n_targets, n_tokens)

    def slices(self, rows: int, max_tokens: int | None = None) -> list[list[int]]:
        """The conversations in order, `rows` at a time, up to the one that reaches max_tokens (None: all)."""
        count, seen = len(self), 0
        if max_tokens is not None:
            for n, ids in enumerate(self.ids, 1):
                seen += len(ids)
                if seen >= max_tokens:
                    count = n
                    break
        return [list(range(s, min(s + rows, count))) for s in range(0, count, rows)]


@dataclass
class ChatSplits:
    """The training and validation conversations, and how many were dropped for not fitting the context."""

    train: ChatExamples
    val: ChatExamples
    dropped: int
    longest: int
    val_conversations: list[Conversation]  # the validation conversations kept, as they were written


def encode_splits(conversations: Sequence[Conversation], template: ChatTemplate, tokenizer: Tokenizer,
                  block_size: int, context: int | None = None) -> ChatSplits:  # fmt: skip
    """Render and tokenize every conversation, drop those longer than block_size + 1 tokens (a row predicts
    block_size of them), and hold out the last tenth (at least one) for validation (context: the model's, which
    block_size may not exceed; None: block_size)."""
    context = block_size if context is None else context
    if len(conversations) < 2:
        raise QkvError("a chat file needs at least 2 conversations: the last tenth (at least one) is held out "
                       "for validation")  # fmt: skip
    eot = end_of_turn(tokenizer)
    encoded = [encode_chat(template, tokenizer, c.messages, eot) for c in conversations]
    longest = max(len(ids) for ids, _ in encoded)
    n_val = max(1, round(len(encoded) * VAL_FRACTION))
    fits = [len(ids) <= block_size + 1 and any(mask[1:]) for ids, mask in encoded]
    parts = []
    for part in (range(len(encoded) - n_val), range(len(encoded) - n_val, len(encoded))):
        kept = [i for i in part if fits[i]]
        parts.append(ChatExamples([encoded[i][0] for i in kept], [encoded[i][1] for i in kept]))
    train, val = parts
    if len(train) == 0 or len(val) == 0:
        which = "training" if not train else "validation"
        shortest = min(len(ids) for ids, _ in encoded)
        fix = "raise --block-size" if shortest <= context + 1 else (
            f"the model's context is {context} tokens: give conversations that fit it")  # fmt: skip
        raise QkvError(f"no {which} conversation fits --block-size {block_size} (the shortest has {shortest} "
                       f"tokens, the longest {longest}); {fix}")  # fmt: skip
    held_out = [conversations[i] for i in range(len(encoded) - n_val, len(encoded)) if fits[i]]
    return ChatSplits(train, val, len(encoded) - len(train) - len(val), longest, held_out)
