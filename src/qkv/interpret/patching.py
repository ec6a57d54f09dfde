"""Activation patching: which activations carry the answer, measured by running the model with them swapped.

Two prompts of the same token length differ where it matters ("The capital of France is" against
"... Italy is"). A metric reads the answer from the logits at the last position: here the logit of the clean
answer minus that of the corrupted one. The corrupted prompt is run again with one activation taken from the
clean run (one layer's stream at one position, or one head's output at every position), and the metric is
reported normalised:

    effect = (metric(patched) − metric(corrupted)) / (metric(clean) − metric(corrupted))

1 means that activation alone restores the clean answer, 0 that it changes nothing, and a negative value
that it pushes further towards the corrupted answer. The patches are exact forward passes (not a gradient
approximation), batched: one forward per layer, one row per position or head. In a decoder LM, a patch in
layer l leaves layers 0..l−1 as the corrupted run computed them, so its forward pass starts at layer l from
the corrupted run's stream (TransformerLens's start_at_layer): half the layers' work over a whole map.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import cast

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


Row = tuple[str, int, Tensor]  # ("resid" or "heads", layer, normalised effects (T,) or (H,))


@dataclass
class PatchingPlan:
    """A patching map ready to compute: the clean run's activations, the metric's two ends, the rows to run."""

    model: nn.Module
    corrupted: Tensor  # (1, T)
    answer: int
    wrong: int
    acts: dict[str, Tensor]  # the clean run's streams entering each layer, and its heads' z
    stack: str
    n_layers: int
    n_heads: int
    heads: bool
    clean: float  # the metric on the clean prompt
    corrupted_metric: float  # the metric on the corrupted prompt
    start: dict[str, Tensor]  # a decoder LM's corrupted streams entering each layer (empty: run whole passes)

    @property
    def total(self) -> int:
        """Batched forward passes (rows of the maps) in all."""
        return self.n_layers * (2 if self.heads else 1)

    def rows(self) -> Iterator[Row]:
        """Each layer's row of the stream map, then of the heads map: one batched forward pass each, computed as
        the iterator is advanced (so that a caller can show, or stop, a map as it fills)."""
        t = self.corrupted.shape[1]
        for i in range(self.n_layers):
            value = self.acts[f"{self.stack}.layers.{i}.resid_pre"][0]  # (T, d)
            yield "resid", i, self._effects(i, f"{self.stack}.layers.{i}.resid_pre", _diagonal(value), t)
        for i in range(self.n_layers) if self.heads else ():
            z = self.acts[f"{self.stack}.layers.{i}.attn.z"][0]  # (T, H, d_v)
            yield "heads", i, self._effects(i, f"{self.stack}.layers.{i}.attn.z", _per_head(z), self.n_heads)

    def _effects(self, layer: int, name: str, patch: Callable[[Tensor], Tensor], rows: int) -> Tensor:
        """The normalised effect of each of `rows` copies of the corrupted prompt, patched at `name` in `layer`."""
        ids = self.corrupted.expand(rows, -1)
        with torch.no_grad(), hooked(self.model, patch={name: patch}):
            if self.start:
                stream = self.start[f"{self.stack}.layers.{layer}.resid_pre"].expand(rows, -1, -1)  # (rows, T, d)
                logits = _last_logits_from(cast(DecoderLM, self.model), ids, layer, stream)
            else:
                logits = _last_logits(self.model, ids)
            metric = logit_diff(logits, self.answer, self.wrong)
        return (metric.float().cpu() - self.corrupted_metric) / (self.clean - self.corrupted_metric)


def plan_patching(model: nn.Module, clean: Tensor, corrupted: Tensor, answer: int, wrong: int,
                  heads: bool = True) -> PatchingPlan:  # fmt: skip
    """Run the clean prompt (keeping its activations) and the corrupted one, and check that patching can show
    anything: prompts (1, T) of the same length that the metric tells apart."""
    if clean.dim() != 2 or clean.shape[0] != 1 or clean.shape != corrupted.shape:
        raise QkvError(f"the clean and corrupted prompts must have the same token length, got "
                       f"{clean.shape[-1]} and {corrupted.shape[-1]} tokens")  # fmt: skip
    readout = readout_of(model)
    stack, n = readout.stack, readout.n_layers
    names = [f"{stack}.layers.{i}.{a}" for i in range(n) for a in ("resid_pre", "attn.z")]
    model.eval()
    with torch.no_grad():
        clean_logits, acts = run_with_cache(model, clean, names=names)
        starts = [name for name in names if name.endswith("resid_pre")] if isinstance(model, DecoderLM) else []
        corrupted_logits, start = run_with_cache(model, corrupted, names=starts)
        base = float(logit_diff(corrupted_logits, answer, wrong)[0])
        top = float(logit_diff(clean_logits, answer, wrong)[0])
    if abs(top - base) < 1e-6:
        raise QkvError("the clean and corrupted prompts give the same logit difference, so no patch can restore "
                       "anything: pick prompts (or tokens) that the model answers differently")  # fmt: skip
    n_heads = acts[f"{stack}.layers.0.attn.z"].shape[2]
    return PatchingPlan(model, corrupted, answer, wrong, acts, stack, n, n_heads, heads, top, base, start)


def activation_patching(model: nn.Module, clean: Tensor, corrupted: Tensor, answer: int, wrong: int,
                        heads: bool = True, progress: Progress | None = None) -> PatchingResult:  # fmt: skip
    """Patch every layer's stream at every position (and every head) from `clean` into `corrupted` (each (1, T))."""
    plan = plan_patching(model, clean, corrupted, answer, wrong, heads)
    maps: dict[str, list[Tensor]] = {"resid": [], "heads": []}
    for done, (kind, _, effects) in enumerate(plan.rows(), start=1):
        maps[kind].append(effects)
        if progress is not None:
            progress(done, plan.total)
    return PatchingResult(plan.clean, plan.corrupted_metric, torch.stack(maps["resid"]),
                          torch.stack(maps["heads"]) if heads else None)  # fmt: skip


def _last_logits(model: nn.Module, ids: Tensor) -> Tensor:
    """(B, 1, vocab) logits at the last position: a decoder LM applies its head there alone (a fifth of
    SmolLM2's forward pass is its 49,152-row head)."""
    if isinstance(model, DecoderLM):
        return model.lm_head(model.hidden(ids)[:, -1:])
    return model(ids)[:, -1:]


def _last_logits_from(model: DecoderLM, ids: Tensor, layer: int, stream: Tensor) -> Tensor:
    """(B, 1, vocab) logits at the last position of `ids`, computed from `stream` (B, T, d) entering `layer` on."""
    _, rope = model.embed(ids)  # the rotary tables of ids' positions (the embeddings themselves are not needed)
    x = stream
    for block in model.decoder.layers[layer:]:
        x = block(x, rope=rope)  # (B, T, d): causal self-attention, as in a whole pass
    x = x[:, -1:]
    return model.lm_head(model.decoder.norm(x) if model.decoder.norm is not None else x)


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
