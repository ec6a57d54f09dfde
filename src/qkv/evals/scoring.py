"""Log-likelihood scoring of (context, continuation) requests, as lm-evaluation-harness does, with less work.

A request's score is log P(continuation | context), summed over the continuation's tokens, and whether every
one of those tokens was the model's argmax ("greedy"). The tokens are lm-eval's: the continuation's tokens are
those of context + continuation after the context's own tokens (a trailing space of the context moves to the
continuation first), an empty context is the end-of-text token (lm-eval uses a beginning-of-text token where
the tokenizer has one; no benchmark here has an empty context), and a sequence longer than the model's window
keeps its last max_positions + 1 tokens.

What lm-eval does not do, and why the numbers are the same anyway:
- A multiple-choice item's choices share their context, so the tokens they have in common run once. The item
  becomes one row: the shared prefix, then each choice's own tokens, every choice at the positions it would
  have alone; a mask lets each choice see the prefix and itself, never another choice. The prefix's keys and
  values are computed once and every choice attends to them, as if from a KV cache.
- Rows of similar lengths run as one batch, padded on the right, which causal attention never lets a real
  token see.
- The vocabulary projection and the softmax run only at the positions that predict a continuation token.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from qkv.errors import QkvError
from qkv.evals.data import Item
from qkv.models import DecoderLM
from qkv.tokenizers import Tokenizer

BATCH_TOKENS = 1024  # tokens (padding included) of a batch's forward pass
HEAD_ROWS = 256  # positions whose logits exist at once (each row is a vocabulary of floats)


@dataclass(frozen=True)
class Score:
    """One request's log-likelihood (nats), whether its continuation is the greedy one, and its length."""

    logprob: float
    greedy: bool
    tokens: int


@dataclass
class _Group:
    """One item's requests as token sequences (each choice: context then continuation) around a shared prefix."""

    index: int
    seqs: list[list[int]]
    conts: list[int]  # continuation tokens at the end of each sequence
    shared: int  # leading tokens common to every sequence, all of them context: run once


def encode_request(tokenizer: Tokenizer, context: str, continuation: str, max_positions: int | None,
                   ) -> tuple[list[int], int]:  # fmt: skip
    """lm-eval's tokens of a request: (context then continuation, truncated on the left; continuation length)."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    if context:
        whole, n_context = tokenizer.encode(context + continuation), len(tokenizer.encode(context))
    else:
        whole, n_context = [_prefix_token(tokenizer), *tokenizer.encode(continuation)], 1
    n_cont = max(0, len(whole) - n_context)  # the continuation may merge into the context's last token
    if max_positions is not None and len(whole) > max_positions + 1:
        whole = whole[-(max_positions + 1) :]
    return whole, min(n_cont, len(whole) - 1)


def _prefix_token(tokenizer: Tokenizer) -> int:
    """The token an empty context stands for: end-of-text, as in lm-eval."""
    if tokenizer.eos_id is None:
        raise QkvError("a request with an empty context needs an end-of-text token, and this tokenizer has none")
    return tokenizer.eos_id


def _group(index: int, seqs: list[list[int]], conts: list[int]) -> _Group:
    """The group of one item's sequences, with its shared prefix (capped to the shortest context)."""
    shared = min(len(s) - n for s, n in zip(seqs, conts, strict=True))
    first = seqs[0]
    for s in seqs[1:]:
        shared = min(shared, next((i for i, (a, b) in enumerate(zip(first, s, strict=False)) if a != b), len(s)))
    return _Group(index, seqs, conts, shared)


@dataclass
class _Row:
    """An item packed into one row: its tokens, their positions, which choice each belongs to (0: the shared
    prefix, c + 1: choice c), and per choice the (column, target) pairs it is scored on."""

    group: _Group
    tokens: list[int]
    positions: list[int]
    owner: list[int]
    scored: list[list[tuple[int, int]]]


def _pack(g: _Group) -> _Row:
    """The row of an item: the shared prefix once, then each choice's remaining input tokens."""
    p = g.shared
    tokens, positions, owner = g.seqs[0][:p], list(range(p)), [0] * p
    scored = []
    for c, (seq, n) in enumerate(zip(g.seqs, g.conts, strict=True)):
        first = len(tokens)  # the column of this choice's token at position p
        tail = seq[p:-1]
        tokens += tail
        positions += range(p, p + len(tail))
        owner += [c + 1] * len(tail)
        # position q predicts token q + 1; position p − 1 is the prefix's last column, later ones this choice's
        scored.append([(q if q < p else first + q - p, seq[q + 1]) for q in range(len(seq) - n - 1, len(seq) - 1)])
    return _Row(g, tokens, positions, owner, scored)


def _batches(rows: list[_Row], budget: int) -> list[list[_Row]]:
    """Rows of similar lengths together, each batch padded to at most `budget` tokens."""
    batches: list[list[_Row]] = []
    for row in sorted(rows, key=lambda r: len(r.tokens)):
        if batches and (len(batches[-1]) + 1) * len(row.tokens) <= budget:
            batches[-1].append(row)
        else:
            batches.append([row])
    return batches


def _hidden(model: DecoderLM, batch: list[_Row]) -> Tensor:
    """Final hidden states (B, T, d) of a batch of packed rows (right-padded)."""
    device = model.lm_head.weight.device
    width = max(len(r.tokens) for r in batch)
    pad = [width - len(r.tokens) for r in batch]
    rows = zip(batch, pad, strict=True)
    ids, positions, owner = (
        torch.tensor(column, dtype=torch.long, device=device)  # (B, T) each
        for column in zip(*[(r.tokens + [0] * n, r.positions + [0] * n, r.owner + [-1] * n) for r, n in rows],
                          strict=True)
    )
    # key j is visible to query i when it is the shared prefix or the same choice (causality is the model's)
    mask = ((owner[:, None, :] == 0) | (owner[:, None, :] == owner[:, :, None])) & (owner[:, None, :] >= 0)
    return model.hidden(ids, positions=positions, mask=mask)  # (B, T, d)


def _score_batch(model: DecoderLM, batch: list[_Row]) -> dict[tuple[int, int], Score]:
    """Each (item index, choice) of a batch's score: the head applied where a continuation token is predicted."""
    where, targets, owners = [], [], []
    for b, row in enumerate(batch):
        for c, pairs in enumerate(row.scored):
            for column, token in pairs:
                where.append((b, column))
                targets.append(token)
                owners.append((row.group.index, c))
    keys = [(row.group.index, c) for row in batch for c in range(len(row.scored))]
    if not targets:  # every continuation merged into its context (rows may even be empty): nothing to score
        return {key: Score(0.0, True, 0) for key in keys}
    hidden = _hidden(model, batch)
    index = torch.tensor(where, device=hidden.device)
    picked = hidden[index[:, 0], index[:, 1]]  # (K, d): only the positions that are scored
    target = torch.tensor(targets, device=hidden.device)
    logprob, greedy = torch.empty(len(targets), dtype=torch.float64), torch.empty(len(targets), dtype=torch.bool)
    for lo in range(0, len(targets), HEAD_ROWS):
        logits = model.lm_head(picked[lo : lo + HEAD_ROWS]).float()  # (k, V)
        t = target[lo : lo + HEAD_ROWS]
        # log_softmax's value at the target, without writing a second (k, V) tensor
        logprob[lo : lo + len(t)] = (logits.gather(1, t[:, None])[:, 0] - logits.logsumexp(-1)).double().cpu()
        greedy[lo : lo + len(t)] = (logits.argmax(-1) == t).cpu()
    sums: dict[tuple[int, int], list[float]] = {}
    greedy_of: dict[tuple[int, int], bool] = {}
    for k, key in enumerate(owners):
        sums.setdefault(key, []).append(float(logprob[k]))
        greedy_of[key] = greedy_of.get(key, True) and bool(greedy[k])
    return {key: Score(sum(sums.get(key, [])), greedy_of.get(key, True), len(sums.get(key, []))) for key in keys}


@torch.inference_mode()
def score_items(model: DecoderLM, tokenizer: Tokenizer, items: Sequence[Item], budget: int = BATCH_TOKENS,
                progress: Callable[[int], None] | None = None) -> list[list[Score]]:  # fmt: skip
    """Each item's per-choice scores, in the items' order (progress: called with the items done so far)."""
    model.eval()
    limit = model.embed.max_positions
    groups = []
    for i, item in enumerate(items):
        encoded = [encode_request(tokenizer, c, x, limit) for c, x in item.requests]
        groups.append(_group(i, [s for s, _ in encoded], [n for _, n in encoded]))
    scores: dict[tuple[int, int], Score] = {}
    done = 0
    for batch in _batches([_pack(g) for g in groups], budget):
        scores.update(_score_batch(model, batch))
        done += len(batch)
        if progress is not None:
            progress(done)
    return [[scores[(i, c)] for c in range(len(item.requests))] for i, item in enumerate(items)]
