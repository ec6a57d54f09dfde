"""Which device a run uses, and the mixed-precision context for a dtype."""

from __future__ import annotations

import contextlib
import ctypes
import functools
import re
import sys
from collections.abc import Iterator
from typing import Any

import torch

from qkv.errors import QkvError
from qkv.io import DTYPES

__all__ = ["DTYPES", "autocast_context", "cpu_threads", "keep_freed_memory", "map_first_allocations",
           "matmul_precision", "out_of_memory", "out_of_memory_advice", "resolve_device", "resolve_dtype"]


def resolve_device(name: str) -> torch.device:
    """'auto' → cuda if present, else cpu; anything else must exist on this machine."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise QkvError(f"unknown device {name!r}; use auto, cpu, cuda or cuda:N") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise QkvError("device cuda requested but no CUDA GPU is available; use --device cpu")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise QkvError(f"device {name!r} does not exist: this machine has {torch.cuda.device_count()} CUDA GPU(s)")
    elif device.type == "mps":
        if not torch.backends.mps.is_available():
            raise QkvError("device mps requested but Apple's MPS backend is not available here; use --device cpu")
    elif device.type != "cpu":
        raise QkvError(f"unsupported device {name!r}; use auto, cpu, cuda, cuda:N or mps")
    return device


def resolve_dtype(dtype: str, device: torch.device) -> str:
    """'auto' → bfloat16 on CUDA (its tensor cores, half the activation memory), float32 elsewhere (a CPU has no
    faster bf16 path for training, and results stay those of full precision); any other name as it is."""
    if dtype != "auto":
        return dtype
    return "bfloat16" if device.type == "cuda" else "float32"


@contextlib.contextmanager
def matmul_precision(device: torch.device, dtype: str) -> Any:
    """TF32 for float32 matmuls and convolutions on CUDA while a run in bf16/fp16 trains (the ops autocast leaves
    in float32); --dtype float32 keeps full float32. Restores the previous setting after."""
    enabled = device.type == "cuda" and dtype != "float32"
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    if enabled:
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    try:
        yield enabled
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


def autocast_context(device: torch.device, dtype: str) -> contextlib.AbstractContextManager[Any]:
    """Mixed precision for bf16/fp16 (weights stay fp32); nothing for fp32."""
    if dtype == "float32":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=getattr(torch, dtype))


@contextlib.contextmanager
def cpu_threads(n: int | None, device: torch.device | None = None) -> Any:
    """PyTorch's intra-op CPU threads set to n while the block (or decorated function) runs.

    None, or a run on a GPU, leaves them as they are. One thread is the fastest for tiny matrices (decoding,
    the toy tasks): with two, each op's threads wait on each other.
    """
    previous = torch.get_num_threads()
    if n is not None and (device is None or device.type == "cpu"):
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


# glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_MMAP_THRESHOLD_MAX = 32 << 20  # glibc's ceiling on 64-bit systems (DEFAULT_MMAP_THRESHOLD_MAX)
_MMAP_THRESHOLD_MIN = 128 << 10  # glibc's default (DEFAULT_MMAP_THRESHOLD_MIN)


@functools.cache
def keep_freed_memory() -> bool:
    """Have glibc keep freed tensor memory for reuse instead of returning it to the OS; True if it applied.

    A CPU training step allocates and frees the same large activations every step. By default glibc maps
    blocks over its (adaptive) threshold fresh from the OS and trims the heap top it frees, so every step
    page-faults its activations in again, and the kernel spends the time zeroing pages. Serving blocks up to
    32 MiB from the heap and never trimming it avoids that (benchmarks/translate_step.py and
    benchmarks/cpu_allocator.py measure it; docs/speed.md has the figures). Linux with glibc only.
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        return bool(libc.mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_MAX) and libc.mallopt(_M_TRIM_THRESHOLD, 1 << 30))
    except (OSError, AttributeError):  # not glibc (musl has no mallopt)
        return False


@contextlib.contextmanager
def map_first_allocations(enabled: bool) -> Iterator[None]:
    """Within: blocks over 128 KiB mapped from the OS (glibc's default), not kept in the heap as
    keep_freed_memory has it; for an FSDP run's first step on the CPU. Nothing changes where that did not apply.

    The first all-gather of each layer creates its unsharded parameters, and each buffer is followed in the heap
    by a small object (tensor metadata) that lives as long as the run. Freed after the layer, the buffer leaves
    a hole of exactly its size between two live objects, and glibc before 2.38 cannot serve an aligned
    allocation of that size (posix_memalign, as PyTorch allocates) from such a hole: every layer would take its
    parameters from fresh memory, all of it resident until the backward pass. Mapped instead, the buffers leave
    no holes. From the second step on they come from the heap again: a freed layer's buffers coalesce (no
    metadata between them) and are reused.
    """
    if not enabled or not keep_freed_memory():
        yield
        return
    libc = ctypes.CDLL("libc.so.6")
    libc.mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_MIN)
    try:
        yield
    finally:
        libc.mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_MAX)


def release_freed_memory() -> None:
    """Return the heap pages that freed scratch left behind to the OS (glibc keeps them, all the more under
    keep_freed_memory): after a load that decoded a file piece by piece, the resident size is then what it holds."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):  # not glibc (musl has no malloc_trim)
            ctypes.CDLL("libc.so.6").malloc_trim(0)


def out_of_memory(error: BaseException) -> str | None:
    """For an allocation that failed (CUDA's or MPS's, the CPU allocator's, numpy's): how much it asked for, in
    words ("" when the message does not say); None for any other error."""
    text = str(error)
    failed = "can't allocate memory" in text or "out of memory" in text
    if not isinstance(error, MemoryError | torch.OutOfMemoryError) and not (isinstance(error, RuntimeError) and failed):
        return None
    if found := re.search(r"allocate ([\d.]+ [KMGT]?i?B)", text):  # numpy's, CUDA's and MPS's wording
        number, unit = found[1].split()
        return f"{number.rstrip('.')} {unit} asked for"  # numpy writes "961. GiB"
    if found := re.search(r"allocate (\d+) bytes", text):  # the CPU allocator's
        return f"{int(found[1]) / 2**30:,.1f} GiB asked for"
    return ""


@contextlib.contextmanager
def out_of_memory_advice(device: torch.device, advice: str) -> Iterator[None]:
    """Turn a failed allocation into a one-line QkvError: where memory ran out, how much was asked for, and
    `advice` on what to lower (torch.OutOfMemoryError is a RuntimeError)."""
    try:
        yield
    except (MemoryError, RuntimeError) as e:
        asked = out_of_memory(e)
        if asked is None:
            raise
        raise QkvError(f"out of memory on {device}{f' ({asked})' if asked else ''}: {advice}") from None
