"""A one-line live progress bar that degrades to plain lines in logs (training's steps, `qkv prepare`'s bytes)."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import TextIO

BAR_WIDTH = 24


def clock(seconds: float) -> str:
    """Seconds as m:ss or h:mm:ss."""
    seconds = max(0, int(seconds))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


class ProgressLine:
    """Redraws one status line on a terminal; elsewhere prints a line every `log_every_s` seconds (None: never)."""

    def __init__(self, stream: TextIO | None = None, enabled: bool = True, log_every_s: float | None = None) -> None:
        self.stream = stream or sys.stderr
        self.enabled = enabled
        self.live = enabled and self.stream.isatty()
        self.log_every_s = log_every_s
        self._last_draw = self._last_log = time.monotonic()
        self._drawn = False  # whether the live line shows something

    def due(self, final: bool = False) -> bool:
        """Whether update() would draw now: a caller can skip computing its text (e.g. reading a GPU's loss)."""
        now = time.monotonic()
        if self.live:
            return final or now - self._last_draw >= 0.1
        return self.enabled and self.log_every_s is not None and (final or now - self._last_log >= self.log_every_s)

    def update(self, fraction: float, text: str, final: bool = False) -> None:
        """Redraw the bar at `fraction` (0 … 1) followed by `text` (at most 10 times a second)."""
        now = time.monotonic()
        if self.live:
            if now - self._last_draw < 0.1 and not final:
                return
            self._last_draw, self._drawn = now, True
            filled = int(BAR_WIDTH * min(max(fraction, 0.0), 1.0))
            self.stream.write("\r" + "█" * filled + "·" * (BAR_WIDTH - filled) + " " + text + " " * 4)
            self.stream.flush()
        elif self.enabled and self.log_every_s is not None and (final or now - self._last_log >= self.log_every_s):
            self._last_log = now
            self.stream.write(text + "\n")
            self.stream.flush()

    def log(self, message: str) -> None:
        """Print a permanent line (above the bar on a terminal)."""
        if not self.enabled:
            return
        if self.live:
            self.stream.write("\r" + " " * 120 + "\r")
        self.stream.write(message + "\n")
        self.stream.flush()

    def close(self) -> None:
        """End the live line."""
        if self.live:
            self.stream.write("\n")
            self.stream.flush()

    def close_if_drawn(self) -> None:
        """End the live line if anything was drawn on it; else leave the terminal as it is."""
        if self.live and self._drawn:
            self.close()
            self._drawn = False

    def clear(self) -> None:
        """Erase the live line (the next update draws afresh)."""
        if self.live and self._drawn:
            self.stream.write("\r" + " " * 120 + "\r")
            self.stream.flush()
            self._drawn = False


def batch_progress(line: ProgressLine, what: str, after_s: float = 5.0,
                   log_every_s: float = 10.0) -> Callable[[int, int], None]:  # fmt: skip
    """A callback (done, total) for a loop over batches that shows `what`, the count and the time left, once the
    whole loop looks to take more than after_s seconds (shorter loops show nothing): redrawn on `line` on a
    terminal, a line every log_every_s seconds in a log."""
    began = time.monotonic()
    logged = [began - log_every_s]  # when a log line was last written

    def show(done: int, total: int) -> None:
        now = time.monotonic()
        spent = now - began
        if done <= 0 or spent <= 0.5 or spent * total / done < after_s:
            return
        text = f"{what}: batch {done:,}/{total:,}  ETA {clock(spent * (total - done) / done)}"
        if line.live:
            line.update(done / total, text, final=done == total)
        elif line.enabled and spent >= after_s and now - logged[0] >= log_every_s:
            logged[0] = now
            line.log(text)

    return show
