"""Helpers shared by several test files (imported as `helpers`: pytest puts tests/ on sys.path)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch

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
