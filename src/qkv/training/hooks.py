"""Callbacks into the training loop: benchmarks and tests observe or time its steps through them, instead of
writing step loops of their own."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import nn


@dataclass
class StepInfo:
    """One optimiser step, as the on_step hook sees it."""

    step: int
    seconds: float  # host wall-clock of the step (drawing batches, forward, backward, optimiser); on a GPU the
    # loop does not wait for the device, so this is the time to queue the step: synchronise to time the GPU
    tokens: int  # tokens the step read, all processes together


@dataclass
class Hooks:
    """Callbacks into the loop: benchmarks time steps with them instead of step loops of their own."""

    on_model: Callable[[nn.Module], None] | None = None  # the model before training (e.g. to swap modules)
    on_step: Callable[[StepInfo], None] | None = None  # after every optimiser step
    evaluate: bool = True  # False: no evaluation, no checkpoint, no files: a pure timing run
