"""Induction heads (Olsson et al., 2022): heads that attend from a token to the token after its previous occurrence.

On "… A B … A" an induction head at the second A attends to B, and copies it: the model predicts B.
It needs a previous-token head in an earlier layer, which writes "the token before me was A" into B's
stream, for the induction head's query (A) to match. On a sequence of random tokens repeated twice, the
second half becomes predictable exactly when such heads exist.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from qkv.interpret.hooks import run_with_cache


def repeated_tokens(batch: int, length: int, vocab: int, generator: torch.Generator, low: int = 0) -> Tensor:
    """(batch, 2 · length) ids: `length` random tokens from [low, vocab), then the same tokens again."""
    first = torch.randint(low, vocab, (batch, length), generator=generator)
    return torch.cat([first, first], dim=1)


def induction_targets(ids: Tensor) -> Tensor:
    """(B, T) the position an induction head at t attends to: one after the token's previous occurrence (−1: none)."""
    b, t = ids.shape
    targets = torch.full((b, t), -1, dtype=torch.long)
    for row in range(b):
        last: dict[int, int] = {}
        for pos, token in enumerate(ids[row].tolist()):
            if token in last and last[token] + 1 < pos:  # the token after it must itself be in the past
                targets[row, pos] = last[token] + 1
            last[token] = pos
    return targets


def induction_scores(pattern: Tensor, ids: Tensor) -> Tensor:
    """Per head (H,): the mean attention from each repeated token to the token after its previous occurrence.

    pattern: (B, H, T, T) attention weights of one layer; ids: (B, T). 1.0 is a perfect induction head.
    """
    targets = induction_targets(ids)  # (B, T)
    rows, cols = (targets >= 0).nonzero(as_tuple=True)
    if rows.numel() == 0:
        return torch.zeros(pattern.shape[1])
    picked = pattern[rows, :, cols, targets[rows, cols]]  # (N, H)
    return picked.float().mean(dim=0)


def previous_token_scores(pattern: Tensor) -> Tensor:
    """Per head (H,): the mean attention from each token (after the first) to the token just before it."""
    return pattern.diagonal(offset=-1, dim1=-2, dim2=-1).float().mean(dim=(0, 2))


def head_scores(model: nn.Module, ids: Tensor, stack: str = "decoder") -> tuple[Tensor, Tensor]:
    """(induction, previous-token) scores, each (L, H), of every self-attention head of model on ids (B, T)."""
    with torch.no_grad():
        _, acts = run_with_cache(model.eval(), ids, names=f"{stack}.layers.*.attn.pattern")
    patterns = [acts[name] for name in sorted(acts, key=lambda n: int(n.split(".")[2]))]
    return (torch.stack([induction_scores(p, ids) for p in patterns]),
            torch.stack([previous_token_scores(p) for p in patterns]))  # fmt: skip
