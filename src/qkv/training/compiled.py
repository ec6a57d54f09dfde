"""torch.compile applied per layer, from outside the model, as torchtitan does.

Each Transformer layer's forward becomes one compiled graph (fullgraph: a graph break raises instead of
quietly running parts eagerly). The layers share one graph: they are instances of one class and dynamo
treats their parameters as inputs. Compiling per layer rather than the whole model is what lets the
wrappers of several processes stay outside the graphs: FSDP gathers each layer's parameters in hooks around
its call, and DDP's gradient all-reduce runs as each layer's backward finishes, overlapping the backward of
the layers below it. The rest (embeddings, final norm, output head, loss) runs eagerly.

On one process there is nothing to keep outside, and the task's whole loss is one graph (compiled_loss): the
model and the cross-entropy together, as nanoGPT computes its loss inside the compiled forward. The loss's
float32 cast, log-softmax and their gradients then fuse into kernels that read the (B, T, V) logits once,
instead of eager kernels that each write a full-size float32 copy of them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import torch
from torch import Tensor, nn

from qkv.errors import QkvError
from qkv.training.recompute import layers_of


def compile_layers(model: nn.Module, dynamic: bool | None) -> int:
    """Compile every encoder and decoder layer's forward in place (after activation checkpointing wraps it, so that
    the recomputation is part of the graph); returns how many layers."""
    layers = layers_of(model)
    if not layers:
        raise QkvError(f"--compile compiles the Transformer layers, and this {type(model).__name__} has none")
    for layer in layers:
        layer.forward = torch.compile(layer.forward, fullgraph=True, dynamic=dynamic)
    return len(layers)


def compiled_loss(loss: Callable[[nn.Module, Any], Tensor], model: nn.Module,
                  dynamic: bool | None) -> Callable[[Any], Tensor]:  # fmt: skip
    """`loss(model, batch)` as one compiled graph (fullgraph) of the batch: forward, loss and their backward."""

    def loss_of(batch: Any) -> Tensor:
        return loss(model, batch)

    return cast(Callable[[Any], Tensor], torch.compile(loss_of, fullgraph=True, dynamic=dynamic))
