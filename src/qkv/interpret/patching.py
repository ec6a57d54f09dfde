"""Activation patching: which activations carry the answer, measured by running the model with them swapped.

Two prompts of the same token length differ where it matters ("The capital of France is" against
"... Italy is"). A metric reads the answer from the logits at the last position: here the logit of the clean
answer minus that of the corrupted one. The corrupted prompt is run again with one activation taken from the
clean run (one layer's stream at one position, or one head's output at every position), and the metric is
reported normalised:

    effect = (metric(patched) − metric(corrupted)) / (metric(clean) − metric(corrupted))

1 means that activation alone restores the clean answer, 0 that it changes nothing, and a negative value
that it pushes further towards the corrupted answer. The patches are exact forward passes (not a gradient
approximation), batched: one forward per layer, one row per position or head.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from qkv.errors import QkvError
from qkv.interpret.hooks import hooked, run_with_cache
from qkv.interpret.lens import readout_of
from qkv.models import DecoderLM

Progress = Callable[[int, int], None]  # (done, total) forward passes


@dataclass
class PatchingResult:
    """Patching effects (normalised, see the module docstring) and the metric's two ends."""

    clean: float  # metric on the clean prompt
    corrupted: float  # metric on the corrupted prompt
    resid: Tensor  # (L, T): the stream entering layer l at position t, patched
    heads: Tensor | None  # (L, H): head h of layer l at every position, patched (None when not asked)


def logit_diff(logits: Tensor, answer: int, wrong: int) -> Tensor:
    """logit[answer] − logit[wrong] at the last position, per batch row: (B, T, V) → (B,)."""
    return logits[:, -1, answer] - logits[:, -1, wrong]


def activation_patching(model: nn.Module, clean: Tensor, corrupted: Tensor, answer: int, wrong: int,
                        heads: bool = True, progress: Progress | None = None) -> PatchingResult:  # fmt: skip
    """Patch every layer's stream at every position (and every head) from `clean` into `corrupted` (each (1, T))."""
    if clean.dim() != 2 or clean.shape[0] != 1 or clean.shape != corrupted.shape:
        raise QkvError(f"the clean and corrupted prompts must have the same token length, got "
                       f"{clean.shape[-1]} and {corrupted.shape[-1]} tokens")  # fmt: skip
    readout = readout_of(model)
    stack, n, t = readout.stack, readout.n_layers, clean.shape[1]
    names = [f"{stack}.layers.{i}.{a}" for i in range(n) for a in ("resid_pre", "attn.z")]
    model.eval()
    with torch.no_grad():
        clean_logits, clean_acts = run_with_cache(model, clean, names=names)
        corrupted_logits = _last_logits(model, corrupted)
        base = float(logit_diff(corrupted_logits, answer, wrong)[0])
        top = float(logit_diff(clean_logits, answer, wrong)[0])
        n_heads = clean_acts[f"{stack}.layers.0.attn.z"].shape[2]
        total, done = n * (2 if heads else 1), 0
        resid = torch.empty(n, t)
        head_effects = torch.empty(n, n_heads) if heads else None
        for i in range(n):
            value = clean_acts[f"{stack}.layers.{i}.resid_pre"][0]  # (T, d)
            resid[i] = _patched(model, corrupted, f"{stack}.layers.{i}.resid_pre", _diagonal(value), t, answer, wrong)
            done += 1
            if progress is not None:
                progress(done, total)
        for i in range(n) if heads else ():
            assert head_effects is not None
            z = clean_acts[f"{stack}.layers.{i}.attn.z"][0]  # (T, H, d_v)
            head_effects[i] = _patched(model, corrupted, f"{stack}.layers.{i}.attn.z", _per_head(z), n_heads,
                                       answer, wrong)  # fmt: skip
            done += 1
            if progress is not None:
                progress(done, total)
    span = top - base
    if abs(span) < 1e-6:
        raise QkvError("the clean and corrupted prompts give the same logit difference, so no patch can restore "
                       "anything: pick prompts (or tokens) that the model answers differently")  # fmt: skip
    return PatchingResult(top, base, (resid - base) / span,
                          (head_effects - base) / span if head_effects is not None else None)  # fmt: skip


def _patched(model: nn.Module, corrupted: Tensor, name: str, patch: Callable[[Tensor], Tensor], rows: int,
             answer: int, wrong: int) -> Tensor:  # fmt: skip
    """The metric of `rows` copies of the corrupted prompt, row r patched by patch (which knows r's patch)."""
    with hooked(model, patch={name: patch}):
        return logit_diff(_last_logits(model, corrupted.expand(rows, -1)), answer, wrong)


def _last_logits(model: nn.Module, ids: Tensor) -> Tensor:
    """(B, 1, vocab) logits at the last position: a decoder LM applies its head there alone (a fifth of
    SmolLM2's forward pass is its 49,152-row head)."""
    if isinstance(model, DecoderLM):
        return model.lm_head(model.hidden(ids)[:, -1:])
    return model(ids)[:, -1:]


def _diagonal(clean: Tensor) -> Callable[[Tensor], Tensor]:
    """Row r gets the clean stream (T, d) at position r only."""
    def patch(x: Tensor) -> Tensor:  # (T rows, T, d)
        x = x.clone()
        rows = torch.arange(x.shape[0])
        x[rows, rows] = clean.to(x.dtype)
        return x
    return patch


def _per_head(clean: Tensor) -> Callable[[Tensor], Tensor]:
    """Row h gets head h's clean output (T, H, d_v) at every position."""
    def patch(z: Tensor) -> Tensor:  # (H rows, T, H, d_v)
        z = z.clone()
        rows = torch.arange(z.shape[0])
        z[rows, :, rows] = clean.transpose(0, 1).to(z.dtype)  # (H, T, d_v) for head h in row h
        return z
    return patch
