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


# Where attention from a repeated token can go, in the order a key position is counted when it fits several.
PLACES = ("target", "previous occurrence", "itself", "first position", "near target", "elsewhere")


def attention_breakdown(pattern: Tensor, ids: Tensor) -> dict[str, Tensor]:
    """Per head (H,): where the attention from each repeated token goes, averaged; the places add up to 1.

    target: the token after the token's previous occurrence (the induction score); previous occurrence: that
    occurrence itself (target − 1); itself: the query's own position; first position: position 0; near target:
    target − 2, + 1 and + 2; elsewhere: everything else, and "largest elsewhere" is the mean of its largest single
    weight (one other position, or many small ones). pattern: (B, H, T, T), ids: (B, T).
    """
    targets = induction_targets(ids)  # (B, T)
    rows, cols = (targets >= 0).nonzero(as_tuple=True)
    n, t = rows.numel(), ids.shape[1]
    if n == 0:
        return {name: torch.zeros(pattern.shape[1]) for name in (*PLACES, "largest elsewhere")}
    weights = pattern[rows, :, cols].float()  # (N, H, T): each repeated token's attention row
    place = torch.full((n, t), len(PLACES) - 1, dtype=torch.long)  # (N, T), "elsewhere" unless claimed below
    target = targets[rows, cols]
    claims = [(0, target), (1, target - 1), (2, cols), (3, torch.zeros_like(cols)),
              *((4, target + d) for d in (-2, 1, 2))]  # fmt: skip
    for index, keys in reversed(claims):  # the earliest claim is written last, so it wins
        ok = (keys >= 0) & (keys <= cols)
        place[ok.nonzero(as_tuple=True)[0], keys[ok]] = index
    out = {name: (weights * (place == i)[:, None]).sum(-1).mean(0) for i, name in enumerate(PLACES)}
    out["largest elsewhere"] = (weights * (place == len(PLACES) - 1)[:, None]).amax(-1).mean(0)
    return out


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
