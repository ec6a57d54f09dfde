"""Shared test setup: deterministic seeds and one intra-op thread.

The tests use tiny shapes, for which one thread is fastest; with two, every small op pays for
thread hand-offs, which costs 5-10x when the machine's 2 cores are busy with other work.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

torch.set_num_threads(1)


@pytest.fixture(scope="session", autouse=True)
def _cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """The tests' own prepared-data cache (qkv.data.cache), shared by the session and its subprocesses."""
    before = os.environ.get("QKV_CACHE_DIR")
    os.environ["QKV_CACHE_DIR"] = str(tmp_path_factory.mktemp("qkv-cache"))
    yield
    if before is None:
        del os.environ["QKV_CACHE_DIR"]
    else:
        os.environ["QKV_CACHE_DIR"] = before


@pytest.fixture(autouse=True)
def _seed() -> None:
    """Every test starts from the same RNG state, so failures reproduce."""
    torch.manual_seed(0)


@pytest.fixture(scope="session")
def explore_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A working directory with the runs `qkv explore` tests open: runs/lm (2 layers × 2 heads), runs/tr, runs/mlm."""
    from helpers import tiny_data, tiny_settings

    from qkv.tasks import train

    root = tmp_path_factory.mktemp("explore")
    data = tiny_data(root / "data")
    for task, name in (("lm", "lm"), ("translate", "tr"), ("mlm", "mlm")):
        settings = tiny_settings(task, data)
        if task == "lm":
            settings["model"] = {**settings["model"], "n_layers": 2}
        train(task=task, verbose=False, **settings, out_dir=str(root / "runs" / name))
    return root
