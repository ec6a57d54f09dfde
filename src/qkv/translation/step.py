"""The loss shared by every sequence-to-sequence task (translation, copy, reverse) and its evaluation."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import Tensor

from qkv.translation.batching import Seq2SeqBatch


def label_smoothed_loss(logits: Tensor, target: Tensor, pad: int, smoothing: float) -> Tensor:
    """Mean cross-entropy over non-pad targets against (1 − ε)·one-hot + ε/V (PyTorch's label smoothing).

    The paper smooths with ε = 0.1 (§5.4): it "hurts perplexity … but improves accuracy and BLEU".
    logits (B, T, V), target (B, T).
    """
    return F.cross_entropy(logits.flatten(0, 1).float(), target.flatten(), ignore_index=pad, label_smoothing=smoothing)


def batch_logits(model: Callable[..., Any], batch: Seq2SeqBatch) -> Tensor:
    """Teacher-forced logits (B, T, V) of a batch, with padding masked on both sides."""
    return cast(Tensor, model(batch.src, batch.tgt_in, batch.src_mask, batch.tgt_mask))


def batch_loss(model: Callable[..., Any], batch: Seq2SeqBatch, smoothing: float) -> Tensor:
    """Teacher-forced, label-smoothed loss of a batch, with padding masked on both sides."""
    return label_smoothed_loss(batch_logits(model, batch), batch.tgt_out, batch.pad, smoothing)


@torch.no_grad()
def evaluate_batches(model: Callable[..., Any], batches: list[Seq2SeqBatch]) -> float:
    """Plain (unsmoothed) cross-entropy per target token over the batches (call it in eval mode)."""
    total, count = 0.0, 0
    for batch in batches:
        total += float(batch_loss(model, batch, smoothing=0.0)) * batch.n_targets
        count += batch.n_targets
    return total / max(count, 1)
