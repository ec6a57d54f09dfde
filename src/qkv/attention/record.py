"""Seeing the attention weights: one recording context, filled by the reference path of attention.

No layer takes a flag or returns weights. Instead, while a recorder is active, every call of
`scaled_dot_product_attention` takes the readable reference path and appends what it computed:

    with record_attention(model) as rec:
        logits = model(ids)
    rec.weights_of("decoder.layers.*.self_attn")   # one (B, H, T_q, T_k) tensor per layer, in call order

Given a model, each record is labelled with the name of the attention module that made it
(`model.named_modules()` names), and `only` limits recording to the modules it matches; the rest
keep the fused kernel. Without a model, every call is recorded, unlabelled. Threads may record the
same model at once (a server does): each block's hooks act only on the forward pass run inside it.
With no recorder active, nothing is recorded and the fused kernel runs: recording costs nothing when
nobody asks. A model compiled with torch.compile does not record (record with the model itself).
"""

from __future__ import annotations

import contextlib
import fnmatch
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn


@dataclass
class AttentionRecord:
    """One attention call: where it ran, its scores before the softmax and its weights after it."""

    module: str  # e.g. "decoder.layers.1.cross_attn"; "" when recorded without a model
    scores: Tensor  # (..., T_q, T_k): q·k × scale, −inf where masked
    weights: Tensor  # (..., T_q, T_k): softmax(scores), each row sums to 1 (0 for a query that sees no key)


@dataclass
class AttentionRecorder:
    """The records of one `record_attention` block, in call order."""

    records: list[AttentionRecord] = field(default_factory=list)
    recording: bool = True  # inside a module that `only` selects (always, without a model)
    module: str = ""  # the attention module now running

    def add(self, scores: Tensor, weights: Tensor) -> None:
        """Keep one call's scores and weights (detached)."""
        self.records.append(AttentionRecord(self.module, scores.detach(), weights.detach()))

    def weights_of(self, pattern: str = "*") -> list[Tensor]:
        """The weights of every record whose module name matches the glob `pattern`, in call order."""
        return [r.weights for r in self.records if fnmatch.fnmatchcase(r.module, pattern)]

    def scores_of(self, pattern: str = "*") -> list[Tensor]:
        """The pre-softmax scores of every record whose module name matches `pattern`, in call order."""
        return [r.scores for r in self.records if fnmatch.fnmatchcase(r.module, pattern)]


_ACTIVE: ContextVar[AttentionRecorder | None] = ContextVar("qkv_attention_recorder", default=None)


def active_recorder() -> AttentionRecorder | None:
    """The recorder that wants this attention call's weights, or None (then the fused kernel may run)."""
    if torch.compiler.is_compiling():  # a compiled graph never records: it is the fast path, for training
        return None
    recorder = _ACTIVE.get()
    return recorder if recorder is not None and recorder.recording else None


@contextlib.contextmanager
def record_attention(model: nn.Module | None = None, only: str = "*") -> Iterator[AttentionRecorder]:
    """Record attention scores and weights while the block runs (see the module docstring)."""
    recorder = AttentionRecorder(recording=model is None)
    handles = []
    for name, module in model.named_modules() if model is not None else []:
        if getattr(module, "records_attention", False):
            selected = fnmatch.fnmatchcase(name, only)
            handles.append(module.register_forward_pre_hook(_entering(recorder, name, selected)))
            handles.append(module.register_forward_hook(_leaving(recorder)))
    token = _ACTIVE.set(recorder)
    try:
        yield recorder
    finally:
        _ACTIVE.reset(token)
        for handle in handles:
            handle.remove()


def _entering(recorder: AttentionRecorder, name: str, selected: bool) -> Any:
    """A forward pre-hook that labels the records of module `name` (and records it only if selected)."""

    def hook(module: nn.Module, args: Any) -> None:
        # Only for the forward pass of this recorder's own block: another thread may be running the same model.
        if _ACTIVE.get() is recorder:
            recorder.module, recorder.recording = name, selected

    return hook


def _leaving(recorder: AttentionRecorder) -> Any:
    """A forward hook that stops recording when an attention module returns."""

    def hook(module: nn.Module, args: Any, output: Any) -> None:
        if _ACTIVE.get() is recorder:
            recorder.module, recorder.recording = "", False

    return hook
