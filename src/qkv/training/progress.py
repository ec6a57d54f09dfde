"""The training loop's progress bar: step, loss, tokens/s and the time left (qkv.io.progress draws it)."""

from __future__ import annotations

from typing import TextIO

from qkv.io.progress import ProgressLine, clock


class Progress(ProgressLine):
    """One status line of a training run; plain lines (log) only, in a log file."""

    def __init__(self, total_steps: int, stream: TextIO | None = None, enabled: bool = True) -> None:
        super().__init__(stream, enabled)
        self.total = total_steps

    def update_step(self, step: int, loss: float, tokens_per_s: float, eta_s: float, note: str = "") -> None:
        """Redraw the bar for this step (note: the task's own measures of it, e.g. GRPO's rewards)."""
        text = f"step {step}/{self.total}  loss {loss:.4f}  {note}{tokens_per_s:,.0f} tok/s  ETA {clock(eta_s)}"
        self.update(step / max(1, self.total), text, final=step >= self.total)
