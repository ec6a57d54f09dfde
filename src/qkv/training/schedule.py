"""Learning-rate schedules: linear warmup followed by cosine, linear, constant or inverse-sqrt decay."""

from __future__ import annotations

import math
from dataclasses import dataclass

from qkv.errors import QkvError

SCHEDULE_KINDS = ("cosine", "linear", "constant", "inverse_sqrt")


@dataclass(frozen=True)
class LRSchedule:
    """A learning rate as a pure function of the optimizer step (counted from 0).

    Every kind warms up linearly as ``peak_lr * (step + 1) / warmup_steps`` (nanoGPT's convention,
    so the very first step already moves the weights) and returns ``min_lr`` from ``total_steps`` on.
    """

    peak_lr: float
    warmup_steps: int
    total_steps: int
    min_lr: float = 0.0
    kind: str = "cosine"

    def __post_init__(self) -> None:
        """Reject settings that would silently produce a nonsensical schedule."""
        for name in ("peak_lr", "min_lr"):
            value = getattr(self, name)
            if not math.isfinite(value) or value < 0:
                raise QkvError(f"schedule {name} must be a finite number >= 0, got {value}")
        if self.min_lr > self.peak_lr:
            raise QkvError(f"schedule min_lr ({self.min_lr}) must not exceed peak_lr ({self.peak_lr})")
        if self.warmup_steps < 0:
            raise QkvError(f"schedule warmup_steps must be >= 0, got {self.warmup_steps}")
        if self.total_steps < 1:
            raise QkvError(f"schedule total_steps must be >= 1, got {self.total_steps}")
        if self.warmup_steps > self.total_steps:
            raise QkvError(
                f"schedule warmup_steps ({self.warmup_steps}) must not exceed total_steps ({self.total_steps})"
            )
        if self.kind not in SCHEDULE_KINDS:
            raise QkvError(f"unknown schedule kind {self.kind!r}; choose one of: {', '.join(SCHEDULE_KINDS)}")

    def lr_at(self, step: int) -> float:
        """Return the learning rate to use for optimizer step ``step`` (0-based)."""
        if step < 0:
            raise QkvError(f"schedule step must be >= 0, got {step}")
        if step >= self.total_steps:
            return self.min_lr
        if step < self.warmup_steps:
            return self.peak_lr * (step + 1) / self.warmup_steps
        if self.kind == "constant":
            return self.peak_lr
        if self.kind == "inverse_sqrt":
            # "Attention Is All You Need": d_model^-0.5 * min(s^-0.5, s * warmup^-1.5), 1-based s.
            # Dividing by its value at s = warmup cancels d_model and makes the peak exactly peak_lr;
            # after warmup this is peak * sqrt(warmup / s). Floored at min_lr like the other kinds.
            s = step + 1
            return max(self.min_lr, self.peak_lr * math.sqrt(max(self.warmup_steps, 1) / s))
        # Progress through the decay phase, 0 at the end of warmup, approaching 1 at total_steps.
        progress = (step - self.warmup_steps) / (self.total_steps - self.warmup_steps)
        if self.kind == "linear":
            return self.min_lr + (self.peak_lr - self.min_lr) * (1.0 - progress)
        return self.min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (self.peak_lr - self.min_lr)
