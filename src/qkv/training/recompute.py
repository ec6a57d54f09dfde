"""Activation checkpointing: each Transformer layer keeps only its input for the backward pass, and runs its forward
again there to get the activations back. A layer's activations (attention weights, the feed-forward's 4·d hidden
units, …) are what fills memory in training; this trades them for one more forward pass per layer.

Applied from outside the model, as torchtitan does (the model's code does not change): each layer's forward is
wrapped in torch.utils.checkpoint, non-reentrant, with the random state of dropout replayed, so the gradients are
those of the plain run. Without gradients (evaluation, generation) a layer runs as before.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint


def _recomputed(forward: Callable[..., Any]) -> Callable[..., Any]:
    """`forward`, run under checkpoint when gradients are being recorded."""

    @functools.wraps(forward)
    def run(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        return checkpoint(forward, *args, use_reentrant=False, preserve_rng_state=True, **kwargs)

    return run


def layers_of(model: nn.Module) -> list[nn.Module]:
    """The model's Transformer layers: its encoder's and its decoder's."""
    return [layer for stack in ("encoder", "decoder") for layer in getattr(getattr(model, stack, None), "layers", [])]


def checkpoint_layers(model: nn.Module) -> int:
    """Recompute every layer's activations in the backward pass (in place); returns how many layers."""
    layers = layers_of(model)
    for layer in layers:
        layer.forward = _recomputed(layer.forward)
    return len(layers)
