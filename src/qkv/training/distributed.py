"""Data-parallel (DDP) and sharded (FSDP2) training on PyTorch's own distributed engine.

qkv has no communication layer of its own: `torchrun` (or `qkv train --nproc N`, which calls the same
elastic launcher) starts one process per rank and sets RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR;
this module turns that into a process group (gloo on CPU, nccl on CUDA), wraps the model, and offers
the few collectives the training loop needs. With one process everything here is a no-op, so a plain
`qkv train` runs exactly the code path it always did.

Data parallelism by a *global* batch: every rank draws the same examples for the whole step (world size ×
grad_accum micro-batches of B) from the same seeded generator and keeps its own slices (qkv.training.loop),
so N ranks × B see exactly the examples 1 rank × N·B sees, and the data generator's state in a checkpoint
is independent of the world size.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

from qkv.errors import QkvError
from qkv.io.files import atomic_stream_safetensors
from qkv.training.config import STRATEGIES
from qkv.training.recompute import layers_of

# Test-only fault injection: "RANK:STEP" makes that rank die with os._exit(1) when it reaches STEP
# ("RANK:save:STEP": while saving STEP's checkpoint, before the commit).
CRASH_ENV = "QKV_TEST_CRASH_AT"


def env_rank() -> int:
    """This process's global rank as the launcher set it (0 outside torchrun)."""
    return int(os.environ.get("RANK", "0"))


def env_world_size() -> int:
    """The number of processes as the launcher set it (1 outside torchrun)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def is_main_process() -> bool:
    """True on rank 0, the only rank that prints and writes files (also after the group is gone)."""
    return env_rank() == 0


@dataclass(frozen=True)
class DistContext:
    """Where this process stands in the run: rank, world size, strategy and its device."""

    rank: int
    world_size: int
    strategy: str
    device: torch.device
    checkpoint_group: Any = None  # a gloo group of its own: a background checkpoint's collectives use no other
    control_group: Any = None  # a gloo group for the loop's per-step counts and flags, on the host

    @property
    def enabled(self) -> bool:
        """True when there is more than one process (and so a process group)."""
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        """True on rank 0."""
        return self.rank == 0

    @property
    def sharded(self) -> bool:
        """True when parameters are sharded across ranks (FSDP)."""
        return self.enabled and self.strategy == "fsdp"


def join_groups(backend: str, timeout_s: float, **init: Any) -> tuple[Any, Any]:
    """Join the default process group, then make the run's two gloo groups: (checkpoint_group, control_group)."""
    dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s), **init)
    side = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
    # The loop's per-step collectives exchange host values: on a CPU group, reading them does not wait for the
    # GPU's queued work, which an NCCL collective would (and then the GPU idles while the next step is prepared).
    control = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
    return side, control


@contextlib.contextmanager
def process_group(device: torch.device, strategy: str, timeout_s: float) -> Iterator[DistContext]:
    """Join the launcher's process group for the duration of a run (nothing to join with one process).

    The timeout bounds every collective: when a rank dies, the others fail after at most this long
    instead of waiting forever (torchrun usually notices the dead rank first and stops them sooner).
    """
    if strategy not in STRATEGIES:
        raise QkvError(f"unknown strategy {strategy!r}; choose one of: {', '.join(STRATEGIES)}")
    world = env_world_size()
    if world == 1:
        if device.type == "cuda" and device.index is None:  # "cuda" → "cuda:0", as tensors on it report
            device = torch.device("cuda", torch.cuda.current_device())
        yield DistContext(0, 1, strategy, device)
        return
    if "MASTER_ADDR" not in os.environ:
        raise QkvError("WORLD_SIZE > 1 but no MASTER_ADDR: start distributed runs with torchrun or --nproc")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device.type == "cuda":  # one process per GPU: rank i of this node drives GPU i
        device = torch.device("cuda", local_rank if device.index is None else device.index)
        torch.cuda.set_device(device)
    elif device.type != "cpu":
        raise QkvError(f"distributed training runs on cpu (gloo) or cuda (nccl), not {device.type}")
    side, control = join_groups("nccl" if device.type == "cuda" else "gloo", timeout_s)
    ctx = DistContext(dist.get_rank(), dist.get_world_size(), strategy, device, side, control)
    try:
        yield ctx
        # Leave together: a rank that tears gloo down while a peer is still writing the last
        # checkpoint can abort in gloo's background thread ("terminate called without an active exception").
        dist.barrier()
    except RuntimeError as e:
        if not _is_communication_error(e):
            raise
        # A peer died or timed out: one clear line instead of a traceback through the collective.
        reason = re.sub(r"^\[[^\]]*\]\s*", "", str(e).strip().splitlines()[0]).split(". ")[0]
        raise QkvError(
            f"rank {ctx.rank}: lost contact with the other training processes ({reason}); one of them died "
            f"or hung for more than --dist-timeout {timeout_s:g} s. Continue from the last checkpoint with --resume"
        ) from None
    finally:
        dist.destroy_process_group()


def _is_communication_error(e: RuntimeError) -> bool:
    """True for a failed collective: torch's DistError, or the plain RuntimeError that gloo raises."""
    text = str(e).lower()
    return isinstance(e, dist.DistError) or "gloo" in text or "nccl" in text


def wrap_model(model: nn.Module, ctx: DistContext, dtype: str = "float32") -> nn.Module:
    """The module to train: DDP around `model`, or `model` itself sharded in place by FSDP2's fully_shard.

    dtype: the run's autocast dtype; in bf16 or fp16, FSDP gathers the parameters in it (half the traffic) and
    reduces the gradients in float32, while the sharded parameters and the optimizer stay float32.
    """
    if not ctx.enabled:
        return model
    # BatchNorm's running statistics would drift apart per rank, whichever the strategy: refused.
    if any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules()):
        raise QkvError("norm=batch keeps per-rank running statistics; use layer or rms norm with several processes")
    if ctx.strategy == "ddp":
        device_ids = [ctx.device.index] if ctx.device.type == "cuda" else None
        # Buffers are fixed tables (rotary, sinusoidal) or fixed routing biases, identical everywhere:
        # syncing them before every forward would be wasted traffic.
        return DistributedDataParallel(model, device_ids=device_ids, forward_sync_buffers=False)
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method

    half = {"bfloat16": torch.bfloat16, "float16": torch.float16}.get(dtype)
    policy = MixedPrecisionPolicy(param_dtype=half, reduce_dtype=torch.float32 if half else None)
    # One FSDP unit per encoder and decoder layer (its parameters are gathered just before it runs, freed
    # after), then the root for the rest: the embeddings and the tied output head share one unit.
    for layer in layers_of(model):
        fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    for method in ("encode", "decode"):  # an encoder–decoder is also called through these, not only forward
        if hasattr(model, method):
            register_fsdp_forward_method(model, method)
    return model


@contextlib.contextmanager
def gradient_sync(model: nn.Module, enabled: bool) -> Iterator[None]:
    """Run a micro-batch's forward + backward with or without the gradient all-reduce.

    With gradient accumulation only the last micro-batch needs to average gradients across ranks;
    the others just add into the local .grad (DDP's no_sync, FSDP2's set_requires_gradient_sync).
    """
    if enabled:
        yield
    elif isinstance(model, DistributedDataParallel):
        with model.no_sync():
            yield
    elif hasattr(model, "set_requires_gradient_sync"):  # an FSDP2 module
        fsdp_module = cast(Any, model)  # FSDP2 swaps the class at run time; mypy sees a plain Module
        fsdp_module.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            fsdp_module.set_requires_gradient_sync(True)
    else:
        yield


def agree(value: str, ctx: DistContext) -> str:
    """Rank 0's value on every rank (e.g. the timestamped default run directory, chosen once)."""
    if not ctx.enabled:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return str(box[0])


def sum_over_ranks(values: list[int], ctx: DistContext) -> list[int]:
    """Integer counts (e.g. a step's target tokens) summed over all ranks."""
    if not ctx.enabled:
        return values
    t = torch.tensor(values, dtype=torch.int64)
    dist.all_reduce(t, group=ctx.control_group)
    return [int(v) for v in t.tolist()]


def mean_over_ranks(value: float, ctx: DistContext) -> float:
    """The average of a float over all ranks (e.g. each rank's training loss, for logging)."""
    if not ctx.enabled:
        return value
    t = torch.tensor([value], dtype=torch.float64, device=ctx.device)
    dist.all_reduce(t)
    return float(t) / ctx.world_size


def any_rank(flag: bool, ctx: DistContext) -> bool:
    """True if `flag` is true on any rank, so that all ranks stop (Ctrl-C, time budget) at the same step."""
    if not ctx.enabled:
        return flag
    t = torch.tensor([int(flag)])
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=ctx.control_group)
    return bool(t)


def export_weights(model: nn.Module, paths: list[Path], ctx: DistContext, skip: set[str]) -> None:
    """Write the model's weights whole to each of `paths` (safetensors, rank 0), gathering one tensor at a time.

    Every rank must call this: under FSDP each sharded tensor is all-gathered in turn, so no process ever
    holds more than one whole tensor beyond its own shards. skip: names left out (a LoRA run's frozen base).
    """
    from torch.distributed.tensor import DTensor

    state = {k: v for k, v in model.state_dict().items() if k not in skip}  # DTensor shards under FSDP

    def whole() -> Iterator[Tensor]:
        for value in state.values():
            yield value.full_tensor() if isinstance(value, DTensor) else value  # a collective per tensor

    specs = [(k, v.dtype, tuple(v.shape)) for k, v in state.items()]
    if ctx.is_main:
        atomic_stream_safetensors(paths, specs, whole())
    else:
        for _ in whole():
            pass


def seed_dropout(seed: int, step: int, ctx: DistContext) -> None:
    """Give each rank its own dropout stream (identical masks on every rank would correlate the noise).

    One process keeps the checkpointed RNG untouched, so its resumes stay bit-exact; with several, the
    masks depend on the rank and on the step the run (re)started at.
    """
    if ctx.enabled:
        torch.manual_seed(seed + 1_000_003 * ctx.rank + 7919 * step)


def crash_for_test(point: int | str, ctx: DistContext) -> None:
    """Test-only: die abruptly where QKV_TEST_CRASH_AT=RANK:POINT says: at a step (RANK:13), or during the save of
    a step, after its shards are written and before it is committed (RANK:save:10)."""
    target = os.environ.get(CRASH_ENV)
    if target and target == f"{ctx.rank}:{point}":
        print(f"rank {ctx.rank}: {CRASH_ENV} reached, exiting", file=sys.stderr, flush=True)
        os._exit(1)


def launch(nproc: int, argv: list[str], run_dir: str) -> int:
    """Run `python -m qkv ARGV` in `nproc` local processes via torch's elastic launcher (torchrun's engine)."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    if "RANK" in os.environ:
        raise QkvError("--nproc starts its own processes; under torchrun leave it out")
    # torchrun --standalone's settings: a private rendezvous on a free local port, no restarts.
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=f"qkv-{uuid.uuid4().hex[:12]}",
                          rdzv_backend="c10d", rdzv_endpoint="localhost:0", max_restarts=0)  # fmt: skip
    # Split the cores instead of letting every process start one thread per core (torchrun sets 1).
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    try:
        elastic_launch(config, sys.executable)("-m", "qkv", *argv)
    except ChildFailedError as e:
        rank, failure = e.get_first_failure()
        how = f"exit code {failure.exitcode}" if failure.exitcode >= 0 else f"signal {failure.signal_name()}"
        raise QkvError(
            f"training process rank {rank} failed ({how}; its output is above) and the others were stopped; "
            f"continue from the last checkpoint with --resume --out-dir {run_dir}"
        ) from None
    return 0
