"""Build a model on the meta device, shard it, then fill each rank's shards with eager's exact initial values.

An eager build holds the whole model in every process before FSDP shards it. Built under
`torch.device("meta")` instead, the model has shapes and no storage; FSDP shards it (still without storage),
`to_empty` allocates each rank's shards only, and the values are filled in afterwards, one tensor at a time.

The values must be the ones an eager build would give from the same seed, whatever the process count,
so the initialisation is replayed rather than redone: while the model is built on meta, every write into
a tensor (`uniform_`, `normal_`, `zero_`, `fill_`) is recorded with its shape and arguments. Replaying the
list on CPU scratch tensors of the same shapes, in the same order, draws exactly the numbers eager drew
from the CPU generator (a draw depends only on the shape, the dtype and the generator's state), so both the
weights and the generator's state afterwards match. A tensor's last write is copied into its shards; the
scratch tensor is then dropped, so no process ever holds more than one whole tensor.

State that is not drawn (norm scales, rotary and sinusoidal tables, MoE's balancing bias) is recomputed
by its module's `reset_parameters`, as torchtitan's `init_weights` does.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar, cast

import torch
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode

M = TypeVar("M", bound=nn.Module)
aten = torch.ops.aten
_WRITES = {aten.uniform_.default, aten.normal_.default, aten.zero_.default, aten.fill_.Scalar}
_DRAWS = {  # other ways of drawing random numbers, which the replay does not repeat
    aten.randn, aten.rand, aten.randint, aten.randperm, aten.bernoulli, aten.bernoulli_, aten.exponential_,
    aten.random_, aten.normal, aten.cauchy_, aten.geometric_, aten.log_normal_,
}  # fmt: skip


@dataclass
class _Write:
    """One recorded initialisation write: op(tensor of `shape`, *args)."""

    op: Any
    shape: tuple[int, ...]
    dtype: torch.dtype
    args: tuple[Any, ...]
    storage: int  # the written tensor's storage (its identity while the build runs)
    target: str | None = None  # the parameter it initialises, if that parameter is in the finished model


@dataclass
class MetaPlan:
    """What a meta-device build recorded: the writes to replay, in order."""

    writes: list[_Write] = field(default_factory=list)
    unsupported: str | None = None  # why the build cannot be replayed (then build eagerly)


class _Recorder(TorchDispatchMode):
    """Records the initialisation writes of a build that runs on the meta device."""

    def __init__(self) -> None:
        super().__init__()
        self.plan = MetaPlan()
        self._alive: list[Tensor] = []  # keeps recorded storages alive, so their ids are never reused

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func in _WRITES and args[0].is_meta:
            t = args[0]
            if t.storage_offset() != 0 or t.numel() * t.element_size() != t.untyped_storage().nbytes():
                self.plan.unsupported = f"a partial write ({func}) into a tensor of shape {tuple(t.shape)}"
            elif kwargs.get("generator") is not None:
                self.plan.unsupported = f"{func} with its own generator"
            else:
                self.plan.writes.append(_Write(func, tuple(t.shape), t.dtype, args[1:], t.untyped_storage()._cdata))
                self._alive.append(t)
        elif func.overloadpacket in _DRAWS:
            self.plan.unsupported = f"a random tensor made by {func.overloadpacket}"
        elif func is aten.copy_.default and not args[1].is_meta:
            self.plan.unsupported = "weights loaded into the model while it is built"
        return func(*args, **kwargs)


def build_on_meta(build: Callable[[], M]) -> tuple[M, MetaPlan]:
    """`build()` run on the meta device (no storage, no draws from the generator), and how to replay its init.

    plan.unsupported says when the build did something the replay cannot repeat (it loaded weights, or drew
    a random tensor some other way); the caller then builds eagerly instead.
    """
    with torch.device("meta"), _Recorder() as recorder, warnings.catch_warnings():
        warnings.filterwarnings("ignore", ".*copying from a non-meta parameter")  # recorded: the plan says so
        model = build()
    plan = recorder.plan
    names: dict[int, str] = {}
    for name, p in model.named_parameters():  # a tied weight keeps its first name, as state_dict does
        names.setdefault(p.untyped_storage()._cdata, name)
    for write in plan.writes:
        write.target = names.get(write.storage)
    if plan.unsupported is None:
        plan.unsupported = _uncovered(model, {w.target for w in plan.writes if w.target})
    return model, plan


def build(build_fn: Callable[[], M], on_meta: bool) -> tuple[M, MetaPlan | None]:
    """build_fn()'s model: on the meta device when asked and replayable (plan set), else eagerly (plan None)."""
    if on_meta:
        model, plan = build_on_meta(build_fn)
        if plan.unsupported is None:
            return model, plan
    return build_fn(), None  # the meta build drew nothing from the generator: eager starts from the same state


def materialise(model: nn.Module, plan: MetaPlan, device: torch.device) -> None:
    """Allocate `model` (sharded or not) on device and fill it with the values the eager build gives."""
    swap = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)  # keep each Parameter object: ties survive
    try:
        model.to_empty(device=device)
    finally:
        torch.__future__.set_swap_module_params_on_conversion(swap)
    params = dict(model.named_parameters())
    last = {w.target: i for i, w in enumerate(plan.writes) if w.target is not None}
    with torch.no_grad():
        for module in _resettable(model):
            cast(Any, module).reset_parameters()
        for i, write in enumerate(plan.writes):
            is_value = write.target is not None and last[write.target] == i
            if not is_value and write.op in (aten.zero_.default, aten.fill_.Scalar):
                continue  # overwritten later and draws nothing: no need to run it
            # CPU scratch: the eager build runs on the CPU, so its generator is the one to advance.
            scratch = write.op(torch.empty(write.shape, dtype=write.dtype), *write.args)
            if is_value:
                assert write.target is not None
                _assign(params[write.target], scratch)


def _assign(param: Tensor, full: Tensor) -> None:
    """Copy `full` into param: into this rank's shard when param is a DTensor, the whole tensor otherwise."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if isinstance(param, DTensor):
        # Every rank replays the same values, so each can cut its own shard: no communication.
        shard = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)
        param.to_local().copy_(shard.to_local())
    else:
        param.copy_(full)


def _resettable(model: nn.Module) -> Iterator[nn.Module]:
    """The modules whose own state is not drawn but computed (norms, position tables, MoE's bias)."""
    for module in model.modules():
        if type(module).__module__.startswith("qkv.") and hasattr(module, "reset_parameters"):
            yield module


def _uncovered(model: nn.Module, written: set[str | None]) -> str | None:
    """Why some tensor of the model would have no value after materialise, or None if every one has."""
    reset = {id(m) for m in _resettable(model)}
    has_value = {id(p) for name, p in model.named_parameters() if name in written}  # a tied weight counts once
    for module_name, module in model.named_modules():
        if id(module) in reset:
            continue
        for name, p in module.named_parameters(prefix=module_name, recurse=False):
            if id(p) not in has_value:
                return f"parameter {name} is set by neither a recorded init nor a reset_parameters()"
        for name, _ in module.named_buffers(prefix=module_name, recurse=False):
            return f"buffer {name} of {type(module).__name__}, which has no reset_parameters()"
    return None
