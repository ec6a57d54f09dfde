"""An SAE measured the way the field measures one, on held-out tokens:

    fvu             Σ‖x − x̂‖² / Σ‖x − x̄‖²: the fraction of the activations' variance the SAE does not explain
    l0              latents active per token, on average
    dead_share      the share of latents that did not fire in the last dead_window training tokens
    unfired_share   the share of latents that fire on none of the held-out tokens (meaningful before dead_window)
    loss_clean      the model's next-token loss as it is
    loss_sae        … with the SAE's reconstruction in place of the activation
    loss_zero       … with zeros in place of it
    loss_recovered  (loss_zero − loss_sae) / (loss_zero − loss_clean): 1 when the reconstruction loses nothing

The activations measured are the ones the SAE trains on (the same positions dropped); the losses replace the
activation at those positions and leave the others as they were.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from qkv.data.tokens import TokenSplit
from qkv.errors import QkvError
from qkv.interpret.hooks import hooked
from qkv.sae.activations import Filters, read_activation
from qkv.sae.model import SparseAutoencoder

EVAL_BATCH = 8  # windows read together: the norm filter's median is over them, so every measurement uses 8


def eval_windows(split: TokenSplit, block_size: int, windows: int,
                 batch: int = EVAL_BATCH) -> Iterator[tuple[Tensor, Tensor]]:  # fmt: skip
    """Up to `windows` held-out windows spread evenly over the split, in batches: (ids, next ids), each (B, T)."""
    count = split.window_count(block_size)
    starts = torch.linspace(0, count - 1, min(windows, count)).long()
    for i in range(0, len(starts), batch):
        yield split.windows(starts[i : i + batch], block_size)


def _next_token_loss(model: nn.Module, ids: Tensor, targets: Tensor, hook: str,
                     patch: Callable[[Tensor], Tensor] | None = None) -> float:  # fmt: skip
    """The summed next-token cross-entropy of a batch, with the hook's activation patched (None: as it is)."""
    with torch.no_grad(), hooked(model, patch={hook: patch} if patch is not None else None):
        logits = model(ids)
    return float(F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction="sum"))


def _losses(model: nn.Module, sae: SparseAutoencoder, hook: str, ids: Tensor, targets: Tensor,
            mask: Tensor) -> tuple[float, float, float]:  # fmt: skip
    """A batch's summed next-token loss as it is, with the SAE's reconstruction, and with zeros, at mask (B, T)."""
    keep = mask[..., None]  # (B, T, 1)

    def rebuilt(a: Tensor) -> Tensor:
        return torch.where(keep, sae(a.to(next(sae.parameters()).device)).to(a), a)

    def zeroed(a: Tensor) -> Tensor:
        return torch.where(keep, torch.zeros_like(a), a)

    return (_next_token_loss(model, ids, targets, hook), _next_token_loss(model, ids, targets, hook, rebuilt),
            _next_token_loss(model, ids, targets, hook, zeroed))  # fmt: skip


@dataclass
class _Sums:
    """Running sums over the held-out rows, in float64."""

    sse: float = 0.0  # Σ‖x − x̂‖²
    sum_sq: float = 0.0  # Σ‖x‖²
    total: Tensor | None = None  # Σx (d,)
    rows: int = 0
    active: float = 0.0  # Σ L0
    targets: int = 0
    losses: tuple[float, float, float] = (0.0, 0.0, 0.0)  # clean, with the SAE, zeroed
    fired: Tensor | None = None  # (d_sae,) bool: latents that fired on some held-out row

    def add(self, x: Tensor, recon: Tensor, latents: Tensor) -> None:
        """One batch's rows (N, d), their reconstruction and latents."""
        total = x.double().sum(0).cpu()
        self.total = total if self.total is None else self.total + total
        self.sse += float((x - recon).double().pow(2).sum())
        self.sum_sq += float(x.double().pow(2).sum())
        self.rows += len(x)
        self.active += float((latents > 0).sum())
        fired = (latents > 0).any(0).cpu()
        self.fired = fired if self.fired is None else self.fired | fired

    def fvu(self) -> float:
        """The fraction of variance unexplained."""
        assert self.total is not None
        return self.sse / (self.sum_sq - float(self.total.pow(2).sum()) / self.rows)


def sae_measures(model: nn.Module, sae: SparseAutoencoder, hook: str, batches: Iterator[tuple[Tensor, Tensor]],
                 filters: Filters, losses: bool = True) -> dict[str, float]:  # fmt: skip
    """FVU, L0, dead share and (losses=True) the three next-token losses and the loss recovered (module docstring)."""
    device, sae_device = next(model.parameters()).device, next(sae.parameters()).device
    sums = _Sums()
    for ids, targets in batches:
        ids, targets = ids.to(device), targets.to(device)
        acts = read_activation(model, hook, ids)  # (B, T, d)
        mask = filters.mask(ids, acts)  # (B, T)
        x = acts[mask].float().to(sae_device)  # (N, d)
        with torch.no_grad():
            latents = sae.encode(x)
            sums.add(x, sae.decode(latents), latents)
        if losses:
            sums.targets += targets.numel()
            batch = _losses(model, sae, hook, ids, targets, mask)
            sums.losses = tuple(a + b for a, b in zip(sums.losses, batch, strict=True))  # type: ignore[assignment]
    if sums.rows < 2:
        raise QkvError("fewer than 2 held-out activations were kept to measure the SAE on; give more validation text")
    assert sums.fired is not None
    out = {"fvu": sums.fvu(), "l0": sums.active / sums.rows, "dead_share": float(sae.dead().float().mean()),
           "unfired_share": 1.0 - float(sums.fired.float().mean()), "tokens": float(sums.rows)}  # fmt: skip
    if losses:
        clean, with_sae, zero = (loss / sums.targets for loss in sums.losses)
        out |= {"loss_clean": clean, "loss_sae": with_sae, "loss_zero": zero,
                "loss_recovered": (zero - with_sae) / (zero - clean) if zero != clean else float("nan")}  # fmt: skip
    return out
