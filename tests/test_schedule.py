"""Tests for qkv.training.schedule."""

from __future__ import annotations

import itertools
import math

import pytest

from qkv.errors import QkvError
from qkv.training.schedule import LRSchedule


def test_cosine_known_values() -> None:
    """Warmup starts above zero, peaks, passes the midpoint at (peak+min)/2 and ends at min_lr."""
    s = LRSchedule(peak_lr=1e-3, warmup_steps=10, total_steps=110, min_lr=1e-4)
    assert s.lr_at(0) == pytest.approx(1e-4)  # (0 + 1) / 10 of peak, never exactly 0
    assert s.lr_at(9) == pytest.approx(1e-3)
    assert s.lr_at(10) == pytest.approx(1e-3)
    assert s.lr_at(60) == pytest.approx((1e-3 + 1e-4) / 2)
    assert s.lr_at(110) == 1e-4
    assert s.lr_at(10_000) == 1e-4


def test_warmup_is_monotonic_and_decay_is_non_increasing() -> None:
    """The rate rises strictly through warmup and never rises afterwards."""
    for kind in ("cosine", "linear", "constant", "inverse_sqrt"):
        s = LRSchedule(peak_lr=3e-4, warmup_steps=20, total_steps=200, kind=kind)
        warm = [s.lr_at(i) for i in range(20)]
        assert all(a < b for a, b in itertools.pairwise(warm)), kind
        decay = [s.lr_at(i) for i in range(19, 201)]
        assert all(a >= b for a, b in itertools.pairwise(decay)), kind
        assert max(s.lr_at(i) for i in range(200)) == pytest.approx(3e-4), kind


def test_linear_constant_and_inverse_sqrt() -> None:
    """Each decay kind follows its formula."""
    lin = LRSchedule(peak_lr=1.0, warmup_steps=0, total_steps=100, min_lr=0.0, kind="linear")
    assert lin.lr_at(0) == pytest.approx(1.0)
    assert lin.lr_at(50) == pytest.approx(0.5)
    assert lin.lr_at(100) == 0.0
    const = LRSchedule(peak_lr=0.5, warmup_steps=4, total_steps=100, kind="constant")
    assert [const.lr_at(i) for i in range(6)] == pytest.approx([0.125, 0.25, 0.375, 0.5, 0.5, 0.5])
    inv = LRSchedule(peak_lr=2.0, warmup_steps=100, total_steps=10_000, kind="inverse_sqrt")
    assert inv.lr_at(99) == pytest.approx(2.0)
    assert inv.lr_at(399) == pytest.approx(1.0)  # sqrt(100 / 400) of the peak
    # The paper's formula with d_model=512, rescaled so its maximum is the peak, agrees everywhere.
    paper = [512**-0.5 * min((i + 1) ** -0.5, (i + 1) * 100**-1.5) for i in range(1000)]
    scale = 2.0 / max(paper)
    assert [inv.lr_at(i) for i in range(1000)] == pytest.approx([p * scale for p in paper])


def test_warmup_equal_to_total_and_no_warmup() -> None:
    """Edge cases: all-warmup schedules and zero warmup do not divide by zero."""
    s = LRSchedule(peak_lr=1.0, warmup_steps=5, total_steps=5)
    assert s.lr_at(4) == pytest.approx(1.0)
    assert s.lr_at(5) == 0.0
    z = LRSchedule(peak_lr=1.0, warmup_steps=0, total_steps=10)
    assert z.lr_at(0) == pytest.approx(1.0)
    assert math.isfinite(LRSchedule(1.0, 0, 10, kind="inverse_sqrt").lr_at(0))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"peak_lr": -1.0}, "schedule peak_lr must be a finite number >= 0, got -1.0"),
        ({"peak_lr": math.nan}, "schedule peak_lr must be a finite number >= 0, got nan"),
        ({"min_lr": -0.1}, "schedule min_lr must be a finite number >= 0, got -0.1"),
        ({"min_lr": 2.0}, "schedule min_lr (2.0) must not exceed peak_lr (1.0)"),
        ({"warmup_steps": -1}, "schedule warmup_steps must be >= 0, got -1"),
        ({"total_steps": 0, "warmup_steps": 0}, "schedule total_steps must be >= 1, got 0"),
        ({"warmup_steps": 200}, "schedule warmup_steps (200) must not exceed total_steps (100)"),
        (
            {"kind": "step"},
            "unknown schedule kind 'step'; choose one of: cosine, linear, constant, inverse_sqrt",
        ),
    ],
)
def test_validation_errors(kwargs: dict[str, object], message: str) -> None:
    """Invalid settings raise QkvError with an actionable message."""
    args: dict[str, object] = {"peak_lr": 1.0, "warmup_steps": 10, "total_steps": 100, **kwargs}
    with pytest.raises(QkvError) as info:
        LRSchedule(**args)  # type: ignore[arg-type]
    assert str(info.value) == message


def test_negative_step_rejected() -> None:
    """A negative step is an error, not an extrapolation."""
    with pytest.raises(QkvError, match="step must be >= 0"):
        LRSchedule(1.0, 10, 100).lr_at(-1)
