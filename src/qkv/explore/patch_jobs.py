"""Activation patching in the explorer: a map that fills layer by layer while the page polls it.

POST /api/patching checks the prompts and tokens and runs the clean and corrupted prompts (so every bad request
is a 4xx before any work is queued), then computes the map in a thread; /api/patching_status answers with the
rows done so far, which the page draws as they come; /api/patching_cancel stops a map between two forward
passes. One map is computed at a time (on two cores a second one only slows both down), and a map nobody has
asked about for ABANDONED_S stops by itself (the page was closed).

The numbers are qkv.interpret.activation_patching's: its plan (plan_patching) computes the map one batched
forward pass at a time (a layer's row per position, or per head), so each row is shown as soon as it exists.
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
from torch import Tensor

from qkv.errors import QkvError
from qkv.explore.inside import device_of, prompt_ids, single_stack
from qkv.explore.library import RequestError
from qkv.interpret.patching import Row, plan_patching
from qkv.models import DecoderLM

MAX_PATCH_TOKENS = 32  # each layer's pass runs T copies of a T-token prompt: the work grows as L × T²
# Parameters × tokens a whole map may run through the model (~2 FLOPs each): ten times SmolLM2-135M's map of
# "The capital of France is"; longer prompts on large models are refused up front, before any work.
MAX_PATCH_WORK = 2e12
RUNNING = 1  # maps computed at once
START_WAIT_S = 30.0  # how long a new map waits for the one before it to stop (a cancel lands within one pass)
ABANDONED_S = 20.0  # a map not polled for this long stops: the page that asked for it is gone
KEPT = 16  # finished maps kept for their last polls


@dataclass
class Job:
    """One map being computed: its rows so far, its state, and when the page last asked about it."""

    id: str
    total: int  # forward passes (rows) in all
    resid: list[list[float]] = field(default_factory=list)
    heads: list[list[float]] = field(default_factory=list)
    state: str = "running"  # then "done", "cancelled" or "failed"
    error: str | None = None
    polled: float = field(default_factory=time.monotonic)
    stop: threading.Event = field(default_factory=threading.Event)

    def snapshot(self) -> dict[str, Any]:
        """The job as the page reads it: counts, the rows done so far, and the error of a failed one."""
        out = {"job": self.id, "state": self.state, "done": len(self.resid) + len(self.heads), "total": self.total,
               "resid": list(self.resid), "heads": list(self.heads)}  # fmt: skip
        return {**out, "error": self.error} if self.error is not None else out


class PatchJobs:
    """The maps of one server: at most `running` computed at once, each in its own thread."""

    def __init__(self, running: int = RUNNING, wait_s: float = START_WAIT_S, abandoned_s: float = ABANDONED_S,
                 kept: int = KEPT) -> None:  # fmt: skip
        self._slots = threading.BoundedSemaphore(running)
        self.wait_s, self.abandoned_s, self.kept = wait_s, abandoned_s, kept
        self._jobs: OrderedDict[str, Job] = OrderedDict()
        self._lock = threading.Lock()

    def start(self, prepare: Callable[[], tuple[int, Iterator[Row]]]) -> Job:
        """Run prepare() (its errors are the request's), then compute its rows in a thread: (total, rows)."""
        if not self._slots.acquire(timeout=self.wait_s):
            raise RequestError(429, "another patching map is being computed; wait for it to finish or cancel it")
        try:
            total, rows = prepare()
        except BaseException:
            self._slots.release()
            raise
        job = Job(secrets.token_hex(8), total)
        with self._lock:
            self._jobs[job.id] = job
            finished = [j for j in self._jobs.values() if j.state != "running"]
            for old in finished[: max(0, len(self._jobs) - self.kept)]:
                del self._jobs[old.id]
        threading.Thread(target=self._run, args=(job, rows), name=f"qkv-patching-{job.id}", daemon=True).start()
        return job

    def _run(self, job: Job, rows: Iterator[Row]) -> None:
        """Compute the rows one forward pass at a time, stopping between two when cancelled or abandoned.

        The slot is given back before the job's end is published: whoever sees it done may start the next map at
        once, however late this thread runs again.
        """
        ended = "done"
        try:
            with torch.no_grad():
                for done in range(job.total):
                    if done and (job.stop.is_set() or time.monotonic() - job.polled > self.abandoned_s):
                        ended = "cancelled"
                        break
                    kind, _, effects = next(rows)  # the next layer's forward pass
                    (job.resid if kind == "resid" else job.heads).append([float(v) for v in effects])
        except Exception as err:  # a fault of the model, not of the request: the page shows it as the map's end
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
            raise RequestError(404, f"no patching map {job_id[:40]!r}: it finished long ago or never existed")
        job.polled = time.monotonic()
        return job

    def cancel(self, job_id: str) -> Job:
        """Stop a map after its current forward pass."""
        job = self.get(job_id)
        job.stop.set()
        return job


JOBS = PatchJobs()


def single_token(tokenizer: Any, text: str, what: str) -> int:
    """The one token a text is, or a one-line 400 naming the pieces it splits into."""
    ids = tokenizer.encode(text)
    if len(ids) != 1:
        shown = ", ".join(repr(tokenizer.decode([i])) for i in ids[:8]) + (", …" if len(ids) > 8 else "")
        raise QkvError(f"the {what} {text!r} is {len(ids)} tokens ({shown or 'nothing'}); give exactly one token")
    return int(ids[0])


def _top_token(model: DecoderLM, ids: Tensor) -> int:
    """The prompt's most probable next token."""
    with torch.no_grad():
        return int(model.lm_head(model.hidden(ids)[:, -1])[0].argmax())


def patch_limit(model: DecoderLM) -> int:
    """The longest prompt patched: MAX_PATCH_TOKENS, fewer where L passes of T × max(T, H) tokens exceed the work
    budget, and at most the context."""
    cfg, size = model.cfg, sum(p.numel() for p in model.parameters())
    limit = min(MAX_PATCH_TOKENS, cfg.context_length)
    while limit > 1 and size * cfg.decoder.n_layers * limit * max(limit, cfg.max_heads()) > MAX_PATCH_WORK:
        limit -= 1
    return limit


def _same(tokenizer: Any, answer: int, wrong: int) -> QkvError:
    """The refusal of an answer that is also the wrong token."""
    return QkvError(f"the answer and the wrong token are both {tokenizer.decode([answer])!r}; pick two different "
                    "tokens (type them in the answer and wrong boxes)")  # fmt: skip


def start(run: Any, clean_text: str, corrupted_text: str, answer_text: str | None, wrong_text: str | None,
          heads: bool = True, jobs: PatchJobs = JOBS) -> dict[str, Any]:  # fmt: skip
    """Check a patching request, start its map, and say what it measures (the rows come from status())."""
    model = single_stack(run)
    if not isinstance(model, DecoderLM):
        raise QkvError("patching reads the answer at the last position of a prompt: open a language-model run")
    tokenizer, device = run.require_tokenizer(), device_of(model)
    limit = patch_limit(model)
    clean_ids = prompt_ids(run, clean_text, "clean prompt", limit, "patching")
    corrupted_ids = prompt_ids(run, corrupted_text, "corrupted prompt", limit, "patching")
    if len(clean_ids) != len(corrupted_ids):
        raise QkvError(
            f"the clean prompt is {len(clean_ids)} tokens and the corrupted one {len(corrupted_ids)}: "
            "patching swaps activations position by position, so both need the same token length"
        )
    clean, corrupted = torch.tensor([clean_ids], device=device), torch.tensor([corrupted_ids], device=device)
    given = [single_token(tokenizer, t, what) if t else None for t, what in ((answer_text, "answer"),
                                                                             (wrong_text, "wrong token"))]  # fmt: skip
    if given[0] is not None and given[0] == given[1]:
        raise _same(tokenizer, given[0], given[0])
    chosen: dict[str, Any] = {}

    def prepare() -> tuple[int, Iterator[Row]]:  # in the map's slot: the defaults need forward passes
        answer = given[0] if given[0] is not None else _top_token(model, clean)
        wrong = given[1] if given[1] is not None else _top_token(model, corrupted)
        if answer == wrong:
            raise _same(tokenizer, answer, wrong)
        chosen["plan"] = p = plan_patching(model, clean, corrupted, answer, wrong, heads)
        return p.total, p.rows()

    job = jobs.start(prepare)
    p = chosen["plan"]
    return {"job": job.id, "total": job.total, "n_layers": p.n_layers, "n_heads": p.n_heads, "heads": heads,
            "clean_tokens": [tokenizer.decode([i]) for i in clean_ids],
            "corrupted_tokens": [tokenizer.decode([i]) for i in corrupted_ids],
            "answer": {"id": p.answer, "text": tokenizer.decode([p.answer])},
            "wrong": {"id": p.wrong, "text": tokenizer.decode([p.wrong])},
            "clean": p.clean, "corrupted": p.corrupted_metric}  # fmt: skip
