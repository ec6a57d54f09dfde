"""Shared test setup: deterministic seeds and one intra-op thread.

The tests use tiny shapes, for which one thread is fastest; with two, every small op pays for
thread hand-offs, which costs 5-10x when the machine's 2 cores are busy with other work.
"""

from __future__ import annotations

import pytest
import torch

torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _seed() -> None:
    """Every test starts from the same RNG state, so failures reproduce."""
    torch.manual_seed(0)
