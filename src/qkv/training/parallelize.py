"""What the loop trains: the task's model, with memory, compile and parallelism applied from outside it.

The model classes know nothing of these; as torchtitan's parallelize step does, this module takes the model
a task builds and applies, in this order: the meta-device build of a sharded run, activation checkpointing
(so that the recomputation sits inside each compiled layer), per-layer compile with several processes,
DDP or FSDP, materialising the shards on the run's device, and the compiled loss.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import Tensor, nn

from qkv.errors import QkvError
from qkv.lora import lora_modules
from qkv.training import distributed, meta_init
from qkv.training.compiled import compile_layers, step_loss
from qkv.training.config import RunConfig
from qkv.training.recompute import checkpoint_layers
from qkv.training.task import Task


@dataclass
class Prepared:
    """The model as the loop holds it."""

    model: nn.Module  # the task's model (under FSDP its parameters are this rank's shards)
    train_model: nn.Module  # what evaluation calls: DDP or FSDP around the model, or the compiled model
    loss_of: Callable[[Any], Tensor]  # a micro-batch's training loss, compiled where cfg.compile asks
    frozen: set[str]  # a LoRA run's frozen weights, which its checkpoints leave out (its base holds them)


def prepare(task: Task, cfg: RunConfig[Any], ctx: distributed.DistContext,
            on_model: Callable[[nn.Module], None] | None = None) -> Prepared:  # fmt: skip
    """Build `task`'s model and apply cfg's activation checkpointing, compile and strategy on ctx's device.

    on_model sees the whole model before anything is applied, which makes a sharded run build eagerly.
    """
    # Sharded runs build on the meta device and fill each rank's shards after wrapping.
    model, plan = meta_init.build(task.build_model, on_meta=ctx.sharded and on_model is None)
    lora = task.lora_config()
    if lora is not None:  # adapters beside the frozen weights, put in from outside the model as the rest below
        lora.apply(model)
    model = model if plan is not None else model.to(ctx.device)
    frozen = {n for n, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad}
    frozen = frozen if lora_modules(model) else set()  # any other model saves every tensor, frozen or not
    if frozen and ctx.sharded:
        raise QkvError("a run with frozen weights (LoRA) trains on one process or with --strategy ddp, not fsdp")
    if on_model is not None:
        on_model(model)
    system = cfg.system
    if system.activation_checkpointing:
        checkpoint_layers(model)
    if system.compile and ctx.enabled:  # per layer, so that DDP's and FSDP's communication stays outside the graphs
        compile_layers(model, task.dynamic_shapes)
    train_model = distributed.wrap_model(model, ctx, system.dtype)  # DDP around it, or sharded in place
    if plan is not None:
        meta_init.materialise(model, plan, ctx.device)
    loss_of = step_loss(task, model, train_model, system.compile, per_layer=ctx.enabled)
    if system.compile and not ctx.enabled:  # evaluation's graph of the model (training's holds the loss too)
        train_model = cast(nn.Module, torch.compile(model, fullgraph=True, dynamic=task.dynamic_shapes))
    return Prepared(model, train_model, loss_of, frozen)
