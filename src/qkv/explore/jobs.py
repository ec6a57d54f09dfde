"""Background jobs: long computations that run in a thread, one step at a time, while the page polls them.

A job is an iterator of steps: each next() does one unit of work (a forward pass) and returns the job's view so
far (a dict the page draws), so that a map or a dashboard is shown part by part. At most `running` jobs of a
kind run at once (on two cores a second one only slows both down), a cancel lands between two steps, and a job
nobody has asked about for `abandoned_s` stops by itself (the page that asked for it was closed).
"""

from __future__ import annotations

import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from qkv.explore.library import RequestError

START_WAIT_S = 30.0  # how long a new job waits for the one before it to stop (a cancel lands within one step)
ABANDONED_S = 20.0  # a job not polled for this long stops: the page that asked for it is gone
KEPT = 16  # finished jobs kept for their last polls


@dataclass
class Job:
    """One computation: its view so far, its state, and when the page last asked about it."""

    id: str
    total: int  # steps in all
    # (steps done, the view after them), replaced as one, so that a poll never sees a count and a view that differ
    progress: tuple[int, dict[str, Any]] = field(default_factory=lambda: (0, {}))
    state: str = "running"  # then "done", "cancelled" or "failed"
    error: str | None = None
    polled: float = field(default_factory=time.monotonic)
    stop: threading.Event = field(default_factory=threading.Event)

    @property
    def done(self) -> int:
        """Steps done so far."""
        return self.progress[0]

    @property
    def view(self) -> dict[str, Any]:
        """What the steps done so far show."""
        return self.progress[1]

    def snapshot(self) -> dict[str, Any]:
        """The job as the page reads it: counts, its view so far, and the error of a failed one."""
        done, view = self.progress
        out = {"job": self.id, "state": self.state, "done": done, "total": self.total, **view}
        return {**out, "error": self.error} if self.error is not None else out


Steps = Iterator[dict[str, Any]]


class Jobs:
    """The jobs of one kind (`what`, as the page's messages name them): at most `running` at once, each in a thread."""

    def __init__(self, what: str, running: int = 1, wait_s: float = START_WAIT_S, abandoned_s: float = ABANDONED_S,
                 kept: int = KEPT) -> None:  # fmt: skip
        self.what = what
        self._slots = threading.BoundedSemaphore(running)
        self.wait_s, self.abandoned_s, self.kept = wait_s, abandoned_s, kept
        self._jobs: OrderedDict[str, Job] = OrderedDict()
        self._lock = threading.Lock()

    def start(self, prepare: Callable[[], tuple[int, Steps]], view: dict[str, Any] | None = None) -> Job:
        """Run prepare() (its errors are the request's), then its (total, steps) in a thread, showing `view` first."""
        if not self._slots.acquire(timeout=self.wait_s):
            raise RequestError(429, f"another {self.what} is being computed; wait for it to finish or stop it")
        try:
            total, steps = prepare()
        except BaseException:
            self._slots.release()
            raise
        job = Job(secrets.token_hex(8), total, (0, dict(view or {})))
        with self._lock:
            self._jobs[job.id] = job
            finished = [j for j in self._jobs.values() if j.state != "running"]
            for old in finished[: max(0, len(self._jobs) - self.kept)]:
                del self._jobs[old.id]
        threading.Thread(target=self._run, args=(job, steps), name=f"qkv-job-{job.id}", daemon=True).start()
        return job

    def _run(self, job: Job, steps: Steps) -> None:
        """Run the steps, stopping between two when cancelled or abandoned.

        The slot is given back before the job's end is published: whoever sees it done may start the next job at
        once, however late this thread runs again.
        """
        ended = "done"
        try:
            with torch.no_grad():
                for done in range(job.total):
                    if done and (job.stop.is_set() or time.monotonic() - job.polled > self.abandoned_s):
                        ended = "cancelled"
                        break
                    job.progress = (done + 1, next(steps))
        except Exception as err:  # a fault of the model, not of the request: the page shows it as the job's end
            job.error = " ".join(f"{type(err).__name__}: {err}".split())[:500]
            ended = "failed"
        finally:
            self._slots.release()
            job.state = ended

    def get(self, job_id: str) -> Job:
        """The job with this id (marked as polled now), or a 404."""
        with self._lock:
            job = self._jobs.get(job_id)
        if job is None:
            raise RequestError(404, f"no {self.what} {job_id[:40]!r}: it finished long ago or never existed")
        job.polled = time.monotonic()
        return job

    def cancel(self, job_id: str) -> Job:
        """Stop a job after its current step."""
        job = self.get(job_id)
        job.stop.set()
        return job
