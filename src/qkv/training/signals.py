"""Ctrl-C during training: finish the step, save a checkpoint, then stop."""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable, Iterator
from typing import Any


@contextlib.contextmanager
def deferred_interrupt() -> Iterator[Callable[[], bool]]:
    """Turn the first Ctrl-C into a request that the loop honours between steps; a second one stops at once.

    A KeyboardInterrupt raised at an arbitrary point could land inside backward() or between the
    optimizer's updates of moments and weights, and the checkpoint saved after it would hold a
    half-taken step. Only the main thread can install signal handlers; elsewhere nothing changes.
    """
    requested = False

    def handler(signum: int, frame: Any) -> None:
        nonlocal requested
        if requested:  # impatient second Ctrl-C: give up on a clean stop
            signal.signal(signal.SIGINT, signal.default_int_handler)
            raise KeyboardInterrupt
        requested = True

    if threading.current_thread() is not threading.main_thread():
        yield lambda: False
        return
    previous = signal.signal(signal.SIGINT, handler)
    try:
        yield lambda: requested
    finally:
        signal.signal(signal.SIGINT, previous)
