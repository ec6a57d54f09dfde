"""Direct logit attribution: how much each layer and each head writes towards one token's logit.

In a pre-norm model the final stream is a sum: the embeddings plus every sublayer's output, and each
attention output is a sum over heads (Σ_h result_h + b_O). With the final norm's scale frozen at its value
on the final stream (its mean subtraction is linear), the logit is linear in that sum, so it splits exactly
into one term per component: norm(c) · W_U[target], plus the norm's shift and the head's bias. The terms add
up to the real logit (or logit difference); none of it models what later layers would do with a component,
which is what patching measures.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

import torch
from torch import Tensor, nn

from qkv.errors import QkvError
from qkv.interpret.hooks import hook_sites, run_with_cache
from qkv.interpret.lens import readout_of
from qkv.models import DecoderLM
from qkv.norms import LayerNorm, RMSNorm


@dataclass
class Attribution:
    """Each component's direct contribution to logit[target] − logit[contrast] at one position (batch item 0)."""

    layers: Tensor  # (L, 2): per layer, its attention (all heads and b_O) and its feed-forward
    heads: Tensor  # (L, H): each head's result
    embeddings: float  # the token (and position) embeddings
    constant: float  # the final norm's shift and the head's bias: no layer writes them
    total: float  # the model's own logit difference, which the parts add up to

    def parts_sum(self) -> float:
        """Everything added up: equals `total` up to rounding."""
        return float(self.layers.sum()) + self.embeddings + self.constant


def logit_attribution(model: nn.Module, ids: Tensor, target: int, contrast: int | None = None,
                      position: int = -1) -> Attribution:  # fmt: skip
    """Direct logit attribution of a pre-norm decoder language model's logit for `target` (minus `contrast`'s)."""
    readout = readout_of(model)
    if not isinstance(model, DecoderLM) or any(b.norm_placement != "pre" for b in model.cfg.blocks()):
        raise QkvError("direct logit attribution needs a pre-norm decoder: a post-norm layer normalises the "
                       "stream after each sublayer, so the final stream is not a sum of their writes")  # fmt: skip
    n = readout.n_layers
    sites = hook_sites(model)
    names = [f"decoder.layers.{i}.{a}" for i in range(n) for a in ("resid_pre", "attn.result", "attn_out", "ffn_out")]
    with torch.no_grad():
        logits, acts = run_with_cache(model.eval(), ids, names=[x for x in names if x in sites] + [
            f"decoder.layers.{n - 1}.resid_post"])  # fmt: skip
        final = acts[f"decoder.layers.{n - 1}.resid_post"][0, position]  # (d,)
        head = readout.head
        weight = cast(Tensor, head.weight)  # (vocab, d)
        direction = weight[target] - (weight[contrast] if contrast is not None else 0)  # (d,)
        linear = _frozen_norm(readout.norm, final)

        def score(c: Tensor) -> Tensor:  # (..., d) → (...): the component's direct effect on the logit
            return linear(c) @ direction

        per_layer, per_head = [], []
        for i in range(n):
            attn = score(acts[f"decoder.layers.{i}.attn_out"][0, position])
            ffn_name = f"decoder.layers.{i}.ffn_out"
            ffn = score(acts[ffn_name][0, position]) if ffn_name in acts else torch.zeros(())
            per_layer.append(torch.stack([attn, ffn]))
            per_head.append(score(acts[f"decoder.layers.{i}.attn.result"][0, position]))  # (H,)
        embeddings = score(acts["decoder.layers.0.resid_pre"][0, position])
        shift = getattr(readout.norm, "bias", None)
        constant = (shift @ direction if shift is not None else torch.zeros(())) + _bias_diff(head, target, contrast)
        total = logits[0, position, target] - (logits[0, position, contrast] if contrast is not None else 0)
    return Attribution(torch.stack(per_layer), torch.stack(per_head), float(embeddings), float(constant),
                       float(total))  # fmt: skip


def _frozen_norm(norm: nn.Module | None, final: Tensor) -> Callable[[Tensor], Tensor]:
    """The final norm as a linear map, its scale computed once on the final stream: c ↦ γ ⊙ (c − mean c) / σ."""
    if norm is None:
        return lambda c: c
    if isinstance(norm, LayerNorm):
        sigma = torch.sqrt(final.var(unbiased=False) + norm.eps)
        return lambda c: norm.weight * (c - c.mean(-1, keepdim=True)) / sigma
    if isinstance(norm, RMSNorm):
        rms = torch.sqrt(final.pow(2).mean() + norm.eps)
        return lambda c: norm.weight * c / rms
    raise QkvError(f"direct logit attribution cannot linearise a {type(norm).__name__}")


def _bias_diff(head: nn.Module, target: int, contrast: int | None) -> Tensor:
    """The output head's bias for target minus contrast's (zero without a bias)."""
    bias = getattr(head, "bias", None)
    if bias is None:
        return torch.zeros(())
    return bias[target] - (bias[contrast] if contrast is not None else 0)
