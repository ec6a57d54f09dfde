"""Giving freed memory back to the operating system."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools


@functools.cache
def _libc() -> ctypes.CDLL | None:
    """glibc, where the process runs on it (malloc_trim is glibc's)."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
    except OSError:
        return None
    return libc if libc is not None and hasattr(libc, "malloc_trim") else None


def release_freed_memory() -> None:
    """Return the heap pages that freed scratch left behind to the OS (glibc keeps them otherwise): after a load
    that decoded a file piece by piece, the process's resident size is then what it holds."""
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)
