"""The training step and the loss shared by every sequence-to-sequence task (translation, copy, reverse)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from qkv.models import Transformer
from qkv.translation.batching import Seq2SeqBatch


def label_smoothed_loss(logits: Tensor, target: Tensor, pad: int, smoothing: float) -> Tensor:
    """Mean cross-entropy over non-pad targets against (1 − ε)·one-hot + ε/V (PyTorch's label smoothing).

    The paper smooths with ε = 0.1 (§5.4): it "hurts perplexity … but improves accuracy and BLEU".
    logits (B, T, V), target (B, T).
    """
    return F.cross_entropy(logits.flatten(0, 1).float(), target.flatten(), ignore_index=pad, label_smoothing=smoothing)


def batch_loss(model: Transformer, batch: Seq2SeqBatch, smoothing: float) -> Tensor:
    """Teacher-forced, label-smoothed loss of a batch, with padding masked on both sides."""
    logits = model(batch.src, batch.tgt_in, batch.src_mask, batch.tgt_mask)  # (B, T, V)
    return label_smoothed_loss(logits, batch.tgt_out, batch.pad, smoothing)


def train_step(
    model: Transformer, optimizer: torch.optim.Optimizer, batch: Seq2SeqBatch, smoothing: float, grad_clip: float
) -> float:
    """One optimiser step on one batch; returns the batch's loss."""
    loss = batch_loss(model, batch, smoothing)
    loss.backward()
    if grad_clip > 0:
        nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return float(loss.detach())


@torch.no_grad()
def evaluate_batches(model: Transformer, batches: list[Seq2SeqBatch]) -> float:
    """Plain (unsmoothed) cross-entropy per target token over the batches, dropout off."""
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    for batch in batches:
        n = batch.n_tokens
        total += float(batch_loss(model, batch, smoothing=0.0)) * n
        count += n
    model.train(was_training)
    return total / max(count, 1)
