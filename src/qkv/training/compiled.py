"""torch.compile applied per layer, from outside the model, as torchtitan does.

Each Transformer layer's forward becomes one compiled graph (fullgraph: a graph break raises instead of
quietly running parts eagerly). The layers share one graph: they are instances of one class and dynamo
treats their parameters as inputs. Compiling per layer rather than the whole model is what lets the
wrappers of several processes stay outside the graphs: FSDP gathers each layer's parameters in hooks around
its call, and DDP's gradient all-reduce runs as each layer's backward finishes, overlapping the backward of
the layers below it. The rest (embeddings, final norm, output head, loss) runs eagerly.
"""

from __future__ import annotations

import torch
from torch import nn

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
