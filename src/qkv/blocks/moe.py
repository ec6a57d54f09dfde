"""Mixture-of-experts feed-forward, as in DeepSeek-V3: shared experts plus top-k routed experts.

A dense FFN spends every parameter on every token. A mixture of experts holds n_experts FFNs and lets a
router send each token to only top_k of them, so the parameter count grows with n_experts while the
compute per token stays that of top_k (small) FFNs. DeepSeek adds shared experts that every token passes
through, so the routed ones can specialise instead of each relearning common knowledge:

    y = Σ_shared FFN_s(x) + Σ_{e ∈ top-k} g_e · FFN_e(x)

DeepSeek-V3's router:
- scores s = sigmoid(W_r x), one independent affinity per expert (V2 used a softmax);
- selection uses s + b, where b (`score_bias`, HF's e_score_correction_bias) is nudged during training
  to balance the experts' load without an auxiliary loss; the gates g use s itself, never b;
- group-limited routing: the experts form n_groups groups, a group's score is the sum of its two best
  experts', and only the topk_groups best groups may be picked from (this bounds cross-device traffic);
- the top_k gates are renormalised to sum to 1 (norm_topk), then multiplied by a fixed scale.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from qkv.blocks.feed_forward import FeedForward, FeedForwardConfig
from qkv.config import positive
from qkv.errors import QkvError


@FeedForwardConfig.register
@dataclass(frozen=True, kw_only=True)
class MoEConfig(FeedForwardConfig):
    """A mixture of experts (kind "moe"); d_ff, activation, bias and dropout are each expert's."""

    kind: ClassVar[str] = "moe"
    experts: int = 8  # routed experts
    top_k: int = 2  # routed experts each token uses
    shared_experts: int = 1  # experts every token uses
    groups: int = 1  # expert groups for group-limited routing
    topk_groups: int = 1  # groups a token may route into
    norm_topk: bool = True  # renormalise the top-k gates to sum to 1
    scale: float = 1.0  # multiplier on the routed experts' gates (DeepSeek's routed_scaling_factor)

    def check(self) -> None:
        """The feed-forward rules, then routing that can reach top_k experts."""
        super().check()
        if self.d_ff == 0:
            raise QkvError("a mixture of experts needs feed-forward layers: d_ff=0 (attention-only) has none")
        positive(self, "experts", "top_k", "groups", "topk_groups")
        if self.shared_experts < 0:
            raise QkvError(f"shared_experts must be an integer ≥ 0, got {self.shared_experts!r}")
        per_group = self.experts // self.groups
        if self.experts % self.groups or (self.groups > 1 and per_group < 2):
            raise QkvError(f"groups={self.groups} must divide experts={self.experts} into groups of ≥ 2")
        if self.topk_groups > self.groups:
            raise QkvError(f"topk_groups={self.topk_groups} exceeds groups={self.groups}")
        if self.top_k > self.topk_groups * per_group:
            raise QkvError(f"top_k={self.top_k} exceeds the {self.topk_groups * per_group} experts a token may reach")
        if self.scale <= 0:
            raise QkvError(f"scale must be positive, got {self.scale}")

    def build(self, d_model: int) -> MoEFeedForward:
        """The mixture over width d_model."""
        return MoEFeedForward(d_model, self.width(d_model), self.experts, self.top_k, self.shared_experts, self.groups,
                              self.topk_groups, self.norm_topk, self.scale, self.activation, self.dropout,
                              self.bias)  # fmt: skip


class MoEFeedForward(nn.Module):
    """Shared experts on every token plus the top_k of n_experts routed experts (DeepSeek-V3)."""

    score_bias: Tensor

    def __init__(
        self,
        d_model: int,
        d_ff: int,
        n_experts: int,
        top_k: int,
        n_shared: int = 1,
        n_groups: int = 1,
        topk_groups: int = 1,
        norm_topk: bool = True,
        scale: float = 1.0,
        activation: str = "swiglu",
        dropout: float = 0.0,
        bias: bool = False,
    ) -> None:
        super().__init__()
        if n_experts < 1 or n_groups < 1 or n_experts % n_groups or (n_groups > 1 and n_experts // n_groups < 2):
            raise QkvError(f"groups={n_groups} must divide experts={n_experts} into groups of ≥ 2")
        if not 1 <= topk_groups <= n_groups:
            raise QkvError(f"topk_groups must be in [1, groups={n_groups}], got {topk_groups}")
        if not 1 <= top_k <= topk_groups * (n_experts // n_groups):
            raise QkvError(f"top_k={top_k} must be in [1, experts in the allowed groups]")
        self.n_experts, self.top_k, self.n_groups, self.topk_groups = n_experts, top_k, n_groups, topk_groups
        self.norm_topk, self.scale = norm_topk, scale
        self.router = nn.Linear(d_model, n_experts, bias=False)  # W_r: one affinity logit per expert
        self.float_linears = ("router",)  # routed in float32 from its matrix: never quantised
        self.register_buffer("score_bias", torch.zeros(n_experts))  # load-balancing bias b (selection only)
        self.experts = nn.ModuleList(FeedForward(d_model, d_ff, activation, dropout, bias) for _ in range(n_experts))
        # n_shared shared experts summed = one FFN n_shared times as wide (DeepSeek stores them so).
        self.shared = FeedForward(d_model, d_ff * n_shared, activation, dropout, bias) if n_shared else None

    def reset_parameters(self) -> None:
        """The load-balancing bias back to zero (its own state; the experts are initialised as any Linear)."""
        self.score_bias.zero_()

    def route(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """Gates (N, top_k) and expert ids (N, top_k) for tokens x (N, d_model); computed in float32."""
        scores = F.linear(x.float(), self.router.weight.float()).sigmoid()  # (N, E)
        choice = scores + self.score_bias  # the bias steers selection only
        if self.n_groups > 1:
            grouped = choice.view(-1, self.n_groups, self.n_experts // self.n_groups)  # (N, G, E/G)
            group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)  # (N, G): each group's two best experts
            kept = group_scores.topk(self.topk_groups, dim=-1).indices  # (N, topk_groups)
            allowed = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, kept, True)  # (N, G)
            choice = choice.masked_fill(~allowed.repeat_interleave(self.n_experts // self.n_groups, dim=1), -torch.inf)
        experts = choice.topk(self.top_k, dim=-1).indices  # (N, k)
        gates = scores.gather(1, experts)  # (N, k): the unbiased affinities
        if self.norm_topk:
            gates = gates / (gates.sum(dim=-1, keepdim=True) + 1e-20)
        return gates * self.scale, experts

    def forward(self, x: Tensor) -> Tensor:
        """(..., d_model) → (..., d_model)."""
        flat = x.reshape(-1, x.shape[-1])  # (N, d_model)
        gates, experts = self.route(flat)
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):  # only the tokens routed to e pass through expert e
            token, slot = (experts == e).nonzero(as_tuple=True)
            if token.numel():
                out.index_add_(0, token, (expert(flat[token]) * gates[token, slot, None]).to(out.dtype))
        if self.shared is not None:
            out = out + self.shared(flat)
        return out.view_as(x)


__all__ = ["MoEConfig", "MoEFeedForward"]
