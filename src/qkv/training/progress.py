"""A one-line live progress bar (step, loss, tokens/s, ETA) that degrades to plain lines in logs."""

from __future__ import annotations

import sys
import time
from typing import TextIO


def _clock(seconds: float) -> str:
    """Seconds as m:ss or h:mm:ss."""
    seconds = max(0, int(seconds))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


class Progress:
    """Redraws one status line on a terminal; elsewhere prints only when `log` is called."""

    def __init__(self, total_steps: int, stream: TextIO | None = None, enabled: bool = True) -> None:
        self.total = total_steps
        self.stream = stream or sys.stderr
        self.enabled = enabled
        self.live = enabled and self.stream.isatty()
        self._last_draw = 0.0

    def update(self, step: int, loss: float, tokens_per_s: float, eta_s: float) -> None:
        """Redraw the bar (at most 10 times a second)."""
        if not self.live or (time.monotonic() - self._last_draw < 0.1 and step < self.total):
            return
        self._last_draw = time.monotonic()
        width = 24
        filled = int(width * step / max(1, self.total))
        bar = "█" * filled + "·" * (width - filled)
        line = f"\r{bar} step {step}/{self.total}  loss {loss:.4f}  {tokens_per_s:,.0f} tok/s  ETA {_clock(eta_s)}"
        self.stream.write(line + " " * 4)
        self.stream.flush()

    def log(self, message: str) -> None:
        """Print a permanent line (above the bar on a terminal)."""
        if not self.enabled:
            return
        if self.live:
            self.stream.write("\r" + " " * 100 + "\r")
        self.stream.write(message + "\n")
        self.stream.flush()

    def close(self) -> None:
        """End the live line."""
        if self.live:
            self.stream.write("\n")
            self.stream.flush()
