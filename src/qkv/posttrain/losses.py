"""The post-training losses: DPO (sigmoid and IPO) on preference pairs, and GRPO's clipped policy loss with its
group-normalised advantages. Each follows TRL's conventions where the papers leave a choice open, so that the two
give the same numbers (tests/test_posttrain.py runs TRL 1.16 on the same batches).

DPO (Rafailov et al., 2023) raises the policy's log-ratio to a frozen reference on the chosen reply over the
rejected one: with r = β·(log π(y|x) − log π_ref(y|x)), sigmoid's loss is −log σ(r_chosen − r_rejected). IPO (Azar
et al., 2023) regresses the difference of per-token log-ratios to 1/(2β) instead: (Δ/len − 1/(2β))², TRL's length
normalisation, confirmed with IPO's authors.

GRPO (Shao et al., 2024) samples G replies per prompt; a reply's advantage is its reward minus its group's mean,
over the group's standard deviation (+ 1e-4, as TRL). The policy loss is PPO's clipped ratio per token, plus
β times the k3 estimate of the KL divergence to the reference (weighted by the same ratio: TRL's bias correction
for replies sampled by older weights), averaged over every reply token of the batch (TRL's default "dapo").
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor

from qkv.chat.examples import IGNORE

DPOLossKind = Literal["sigmoid", "ipo"]
STD_EPS = 1e-4  # added to a group's standard deviation before dividing by it (TRL's)


def token_logps(logits: Tensor, targets: Tensor) -> Tensor:
    """Each target's log-probability under `logits` (computed in float32), 0 where the target is IGNORE: (B, T)."""
    picked = -F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=IGNORE, reduction="none")
    return picked.view(targets.shape)  # (B, T)


def dpo_losses(logps: Tensor, reference: Tensor, lengths: Tensor, beta: float,
               kind: DPOLossKind = "sigmoid") -> tuple[Tensor, Tensor]:  # fmt: skip
    """Each pair's DPO loss (P,) and each reply's implicit reward β·log-ratio (2P,), from the replies' summed
    log-probabilities under the policy and the reference and their lengths, all (2P,): chosen rows, then rejected."""
    logratios = logps - reference.to(logps.dtype)  # (2P,)
    chosen, rejected = logratios.chunk(2)
    if kind == "sigmoid":
        losses = -F.logsigmoid(beta * (chosen - rejected))
    elif kind == "ipo":
        chosen_len, rejected_len = lengths.to(logps.dtype).clamp(min=1.0).chunk(2)
        losses = (chosen / chosen_len - rejected / rejected_len - 1 / (2 * beta)) ** 2
    else:
        raise ValueError(f"unknown DPO loss {kind!r}")
    return losses, beta * logratios.detach()


def group_advantages(rewards: Tensor, group: int) -> tuple[Tensor, Tensor]:
    """Each reply's advantage (N·G,): its reward minus its group's mean, over the group's (unbiased) standard
    deviation + STD_EPS; and, per group (N,), whether all its rewards were equal (its advantages are then 0)."""
    grouped = rewards.view(-1, group)  # (N, G)
    std = grouped.std(dim=1, keepdim=True)  # (N, 1)
    advantages = (grouped - grouped.mean(dim=1, keepdim=True)) / (std + STD_EPS)
    return advantages.flatten(), torch.isclose(std.squeeze(1), torch.zeros_like(std.squeeze(1)))


def grpo_token_losses(logps: Tensor, old: Tensor | None, reference: Tensor | None, advantages: Tensor,
                      epsilon: tuple[float, float], beta: float) -> tuple[Tensor, Tensor | None]:  # fmt: skip
    """Each reply token's GRPO loss (B, T) and its k3 KL estimate to the reference (None when beta is 0).

    logps, old, reference: (B, T) log-probabilities of the sampled tokens under the policy being trained, the
    policy that sampled them (None: the same weights, a ratio of 1) and the reference; advantages (B,); epsilon:
    the ratio's clip range (1 − low, 1 + high).
    """
    old = logps.detach() if old is None else old
    ratio = torch.exp(logps - old)  # (B, T)
    clipped = torch.clamp(ratio, 1 - epsilon[0], 1 + epsilon[1])
    a = advantages.unsqueeze(1)  # (B, 1)
    losses = -torch.min(ratio * a, clipped * a)
    if beta == 0.0:
        return losses, None
    assert reference is not None, "a KL penalty (beta > 0) needs the reference's log-probabilities"
    delta = reference - logps
    kl = (torch.exp(delta) - delta - 1) * ratio  # k3 (never negative), importance-weighted as TRL corrects it
    return losses + beta * kl, kl


def grpo_loss(token_losses: Tensor, mask: Tensor) -> Tensor:
    """The mean of the reply tokens' losses (mask (B, T)); the loop weights micro-batches by their reply tokens, so a
    step's loss is the mean over all of its reply tokens, TRL's "dapo" aggregation."""
    return (token_losses * mask).sum() / mask.sum().clamp(min=1)
