"""Helpers shared by several test files (imported as `helpers`: pytest puts tests/ on sys.path)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from qkv.attention import record_attention
from qkv.cli import main


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """Train in-process on one thread, like the OMP_NUM_THREADS=1 subprocesses, so floats match bit for bit."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def run_main(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """qkv.cli.main(argv) in-process → (exit code, stdout, stderr); argparse's SystemExit counts as a return."""
    capsys.readouterr()
    try:
        code = main(list(argv))
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    out, err = capsys.readouterr()
    return code, out, err


def with_weights(fn: Callable[..., torch.Tensor], *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """fn(*args, **kwargs) inside record_attention: (its output, the attention weights of its one attention call)."""
    with record_attention() as recorder:
        out = fn(*args, **kwargs)
    (weights,) = recorder.weights_of()
    return out, weights


@dataclass
class Maps:
    """Recorded attention weights per layer, by kind."""

    self_attn: list[torch.Tensor]
    cross_attn: list[torch.Tensor]


def with_maps(model: torch.nn.Module, *args: Any, call: Callable[..., Any] | None = None, **kwargs: Any) -> Any:
    """(call or model)(*args, **kwargs) inside record_attention(model): (its output, Maps of every layer)."""
    with record_attention(model) as recorder:
        out = (call or model)(*args, **kwargs)
    return out, Maps(recorder.weights_of("*self_attn"), recorder.weights_of("*cross_attn"))
