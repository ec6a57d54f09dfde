"""torch.compile applied per layer, from outside the model, as torchtitan does.

Each Transformer layer's forward becomes one compiled graph (fullgraph: a graph break raises instead of
quietly running parts eagerly). The layers share one graph: they are instances of one class and dynamo
treats their parameters as inputs. Compiling per layer rather than the whole model is what lets the
wrappers of several processes stay outside the graphs: FSDP gathers each layer's parameters in hooks around
its call, and DDP's gradient all-reduce runs as each layer's backward finishes, overlapping the backward of
the layers below it. The embeddings, final norm and output head run eagerly, and the task's criterion (its
cross-entropy) is a graph of its own, as torchtitan compiles its loss.

On one process there is nothing to keep outside, and the task's whole loss is one graph: the model and the
criterion together, as nanoGPT computes its loss inside the compiled forward.

Either way the criterion is compiled: its float32 cast, log-softmax and their gradients fuse into kernels that
read the (B, T, V) logits once, instead of eager kernels that each write a full-size float32 copy of them.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, cast

import torch
from torch import Tensor, nn

from qkv.errors import QkvError
from qkv.training.recompute import layers_of
from qkv.training.task import Task


def compile_layers(model: nn.Module, dynamic: bool | None) -> int:
    """Compile every encoder and decoder layer's forward in place (after activation checkpointing wraps it, so that
    the recomputation is part of the graph); returns how many layers."""
    layers = layers_of(model)
    if not layers:
        raise QkvError(f"--compile compiles the Transformer layers, and this {type(model).__name__} has none")
    for layer in layers:
        layer.forward = torch.compile(layer.forward, fullgraph=True, dynamic=dynamic)
    return len(layers)


def step_loss(task: Task, model: nn.Module, wrapped: nn.Module, compile_: bool,
              per_layer: bool) -> Callable[[Any], Tensor]:  # fmt: skip
    """What a training step calls on each micro-batch: task.loss of the model as the loop runs it (`wrapped`:
    DDP or FSDP around `model`, or `model`).

    compile_ and one process: model and criterion as one graph. compile_ and per_layer (the layers compiled by
    compile_layers): the criterion compiled on its own, around the wrapped model's eager call.
    """
    if not compile_:
        return functools.partial(task.loss, wrapped)
    if not per_layer:

        def loss_of(batch: Any) -> Tensor:
            return task.loss(model, batch)

        return cast(Callable[[Any], Tensor], torch.compile(loss_of, fullgraph=True, dynamic=task.dynamic_shapes))
    criterion = torch.compile(task.criterion, fullgraph=True, dynamic=task.dynamic_shapes)
    return lambda batch: cast(Tensor, criterion(task.logits(wrapped, batch), batch))
