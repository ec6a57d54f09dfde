"""The engine: many sequences generated at once, admitted and retired between steps (continuous batching).

Each step, in one thread:
1. admit queued requests into free slots (qkv.engine.rows: rows of one slot cache, or one sequence in the model's
   own cache), preferring the slot that already holds the longest start of the prompt, whose keys are kept (a
   conversation's next turn re-reads only what it adds);
2. one decode step for every sequence that is decoding: one forward pass over all their rows, each at its own
   position, each sampled with its own settings and random generator;
3. prompt chunks (prefill), oldest prompt first, at most qkv.generation.PREFILL_CHUNK tokens in all: one chunk of
   a long prompt, or several short prompts whole, so a long prompt delays the others' next token by one chunk only.

A sequence ends at a stop token, a stop string, max_tokens, a full slot (unless it slides on past the context, as
`qkv generate` does), cancellation or its timeout, and its slot is freed for the next request. Requests beyond the
slots wait in a queue (bounded: past it, submit raises Busy).

Greedy and seeded replies equal qkv.generation.stream's for the same prompt alone (tests/test_engine.py): a row's
numbers do not depend on the other rows. A reused prompt start is the exception where activations are rounded to
bfloat16 (GGUF weights kept quantised): its keys were computed in other chunks than a fresh read computes them,
float sums in another order, and bfloat16's rounding can turn that into a different token many tokens later, as
with llama.cpp's prompt cache. reuse_prompts=False (`qkv serve --no-prompt-cache`) reads every prompt afresh. A
compiled decode step (compiled=True) sums in its own order, and one decoding row runs in another graph than several:
there too, bfloat16 activations can part a reply from the lone one at a near-tie (docs/serving.md measures it).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from qkv.engine.requests import Event, Finished, FinishReason, Request, StopText, Token
from qkv.engine.rows import Read, Rows, rows_for
from qkv.errors import QkvError
from qkv.generation import GREEDY, PREFILL_CHUNK, check_token_ids, common_prefix, sample_next
from qkv.models import DecoderLM, Transformer
from qkv.tokenizers import Tokenizer


class Busy(QkvError):
    """The queue is full: try again shortly."""


class Closed(QkvError):
    """The engine is shutting down and takes no more requests."""


@dataclass
class _Live:
    """A request's progress: its slot, the ids still to read, the token to feed next, what it has said."""

    request: Request
    emit: Callable[[Event], None]
    text: StopText | None
    generator: torch.Generator | None
    row: int = -1
    pending: list[int] = field(default_factory=list)  # ids to read (prefill) before the next token is picked
    cached: int = 0  # prompt tokens whose keys the slot already held when it was admitted
    next_id: int | None = None  # decoding: the token to read next
    said: int = 0
    cancelled: bool = False


@dataclass
class Handle:
    """A submitted request: cancel() ends it at the next step boundary and frees its slot."""

    live: _Live = field(repr=False)

    def cancel(self) -> None:
        """Stop generating for this request (its Finished event says "cancelled")."""
        self.live.cancelled = True


def slots_for(model: DecoderLM, max_batch: int = 8, kv_cache_tokens: int | None = None, compiled: bool = False,
              ) -> Rows:  # fmt: skip
    """A language model's rows: max_batch slots of kv_cache_tokens / max_batch tokens (default: a context) each."""
    if max_batch < 1:
        raise QkvError(f"--max-batch must be ≥ 1, got {max_batch}")
    context = model.cfg.context_length
    tokens = kv_cache_tokens if kv_cache_tokens is not None else max_batch * context
    if tokens < max_batch * 2:
        raise QkvError(f"--kv-cache-tokens {tokens} leaves under 2 tokens per slot for --max-batch {max_batch}")
    return rows_for(model, max_batch, min(context, tokens // max_batch), compiled)


class Engine:
    """Continuous batching over a DecoderLM's slots (max_batch of kv_cache_tokens / max_batch tokens each), or over
    the rows given (an encoder–decoder's: qkv.engine.rows.SourceRows)."""

    def __init__(self, model: DecoderLM | Transformer, tokenizer: Tokenizer | None = None, max_batch: int = 8,
                 kv_cache_tokens: int | None = None, max_queue: int = 256, timeout: float | None = None,
                 reuse_prompts: bool = True, compiled: bool = False, rows: Rows | None = None) -> None:  # fmt: skip
        """kv_cache_tokens: all slots' tokens (default: max_batch contexts); timeout: seconds a request may take;
        compiled: the decode step compiled (qkv.generation.compiled_step); rows: these instead of slots_for's."""
        if rows is None:
            if not isinstance(model, DecoderLM):
                raise QkvError("an encoder–decoder model decodes in the rows its caller builds (rows.SourceRows)")
            rows = slots_for(model, max_batch, kv_cache_tokens, compiled)
        self.kv = rows
        self.model, self.tokenizer, self.max_queue, self.timeout = model, tokenizer, max_queue, timeout
        self.reuse_prompts = reuse_prompts  # False: every prompt is read from its first token
        self.device = next(model.parameters()).device
        self.rows: list[_Live | None] = [None] * self.kv.n_rows
        self.held: list[list[int]] = [[] for _ in range(self.kv.n_rows)]  # the ids whose keys each slot holds
        self.queue: deque[_Live] = deque()
        self.closed = False
        self._lock = threading.Condition()

    def submit(self, request: Request, emit: Callable[[Event], None]) -> Handle:
        """Queue `request`; emit(event) is called from the engine's thread with each Token, then one Finished."""
        if len(request.ids) > self.kv.prompt_tokens and not request.slide:
            raise QkvError(f"the prompt is {len(request.ids)} tokens; a slot reads {self.kv.prompt_tokens}, with room "
                           "for the reply: shorten it, or give the engine more --kv-cache-tokens per slot")  # fmt: skip
        check_token_ids(torch.tensor(request.ids), self.kv.prompt_vocab)
        text = None
        if self.tokenizer is not None:
            text = StopText(self.tokenizer.decode, request.ids, request.stop)
        elif request.stop:
            raise QkvError("stop strings need the model's tokenizer")
        live = _Live(request, emit, text, request.sampling.generator(self.device))
        with self._lock:
            if self.closed:
                raise Closed("the server is shutting down")
            waiting = len(self.queue) - self.rows.count(None)  # queued ones that a free slot will not take
            if waiting >= self.max_queue:
                raise Busy(f"{waiting} requests are waiting for a slot, the most this server queues; retry shortly")
            self.queue.append(live)
            self._lock.notify()
        return Handle(live)

    def busy(self) -> bool:
        """Whether any request is queued or running."""
        return bool(self.queue) or any(r is not None for r in self.rows)

    def counts(self) -> dict[str, int]:
        """Slots in use, slots in all, requests waiting."""
        return {"slots_busy": sum(r is not None for r in self.rows), "slots": len(self.rows), "queued": len(self.queue)}

    def wait(self, timeout: float) -> None:
        """Sleep until a request arrives (or timeout seconds pass)."""
        with self._lock:
            if not self.busy():
                self._lock.wait(timeout)

    def close(self) -> None:
        """Take no more requests (submit raises Closed); those already in go on."""
        with self._lock:
            self.closed = True

    def cancel_all(self) -> None:
        """Cancel every queued and running request (shutting down); the next step ends them."""
        with self._lock:
            for live in [*self.queue, *(r for r in self.rows if r is not None)]:
                live.cancelled = True
            self._lock.notify()

    def abort(self) -> None:
        """End every request with "error" and empty every slot (after a step failed midway)."""
        with self._lock:
            for live in [*self.queue, *(r for r in self.rows if r is not None)]:
                self._finish(live, "error")
            self.queue.clear()
        self._empty_slots()

    def warm_up(self) -> float:
        """Decode a few tokens in one row, then in two and three at once, so that a compiled step is compiled
        before requests come (a row count equal to a fixed size, two key-value heads say, is traced as that size:
        the third row gets a general graph); the slots are emptied after. Returns the seconds it took."""
        begin = time.perf_counter()
        for n in range(1, min(3, len(self.rows)) + 1 if self.kv.capacity >= 4 else 1):
            # One batch at a time: prompts read in one step would start decoding all together, and a first batch of
            # as many rows as there are slots would be traced as that size.
            self.generate([Request([0], 3, GREEDY) for _ in range(n)])
        self._empty_slots()
        return time.perf_counter() - begin

    def _empty_slots(self) -> None:
        """Forget every slot's keys."""
        for row in range(len(self.rows)):
            self.kv.keep(row, 0)
            self.held[row] = []

    @torch.inference_mode()
    def step(self) -> None:
        """Admit, decode every decoding sequence one token, read prompt chunks."""
        self._retire_cancelled()
        self._admit()
        if any(r is not None and r.next_id is not None for r in self.rows):
            self._decode()
        waiting = sorted((r for r in self.rows if r is not None and r.next_id is None), key=lambda r: r.request.created)
        reading, budget = [], PREFILL_CHUNK  # prompt tokens read per step: the oldest prompt's next chunk, then more
        for live in waiting:
            size = min(len(live.pending), PREFILL_CHUNK)
            if size > budget:
                break
            reading.append(live)
            budget -= size
        if reading:
            self._prefill(reading)

    def generate(self, requests: list[Request], on_event: Callable[[int, Event], None] | None = None,
                 ) -> list[tuple[list[Token], Finished]]:  # fmt: skip
        """Run `requests` to the end together (in this thread); each one's tokens and how it ended, in order.
        on_event(k, event) sees request k's events as they come (text to show, progress)."""
        out: list[tuple[list[Token], list[Finished]]] = [([], []) for _ in requests]
        for k, ((tokens, done), request) in enumerate(zip(out, requests, strict=True)):
            self.submit(request, _collect(tokens, done, k, on_event))
        while any(not done for _, done in out):
            self.step()
        return [(tokens, done[0]) for tokens, done in out]

    def _retire_cancelled(self) -> None:
        now = time.monotonic()
        with self._lock:
            for queued in list(self.queue):
                if queued.cancelled or self._expired(queued, now):
                    self.queue.remove(queued)
                    self._finish(queued, "cancelled" if queued.cancelled else "timeout")
        for live in self.rows:
            if live is not None and (live.cancelled or self._expired(live, now)):
                self._finish(live, "cancelled" if live.cancelled else "timeout")

    def _expired(self, live: _Live, now: float) -> bool:
        return self.timeout is not None and now - live.request.created > self.timeout

    def _admit(self) -> None:
        """Move queued requests into free slots: the one holding the longest start of the prompt, else the lowest."""
        with self._lock:
            while self.queue and None in self.rows:
                live = self.queue.popleft()
                ids = live.request.ids
                if live.request.slide:  # a prompt past the context: its end
                    ids = ids[-self.kv.capacity :]
                free = [i for i, r in enumerate(self.rows) if r is None]
                shared = {i: common_prefix(self.held[i], ids) for i in free}
                row = max(free, key=lambda i: (shared[i], -i))
                keep = min(shared[row], len(ids) - 1) if self.reuse_prompts else 0  # the last is read: it picks
                keep = self.kv.keep(row, keep)  # (a sliding-window cache may keep fewer)
                self.held[row] = self.held[row][:keep]
                live.row, live.pending, live.cached = row, ids[keep:], keep
                self.rows[row] = live

    def _prefill(self, reading: list[_Live]) -> None:
        """Read the next chunk of each one's pending ids into its slot; after its last one, pick its next token."""
        reads: list[Read] = []
        for live in reading:
            ids, live.pending = live.pending[:PREFILL_CHUNK], live.pending[PREFILL_CHUNK:]
            reads.append((live.row, torch.tensor([ids], dtype=torch.long, device=self.device), not live.pending))
            self.held[live.row] += ids
        for live, logits in zip(reading, self.kv.prefill(reads), strict=True):
            if logits is not None:
                self._pick(live, logits)

    def _decode(self) -> None:
        """One token for every decoding row: one forward pass over rows [0, n), each at its own position."""
        n = 1 + max(i for i, r in enumerate(self.rows) if r is not None and r.next_id is not None)
        decoding = [r if r is not None and r.next_id is not None else None for r in self.rows[:n]]
        ids = torch.tensor([[r.next_id if r is not None and r.next_id is not None else 0] for r in decoding],
                           device=self.device)  # fmt: skip
        logits = self.kv.decode([r is not None for r in decoding], ids)  # (n, V)
        for i, row in enumerate(decoding):
            if row is not None and row.next_id is not None:
                self.held[i].append(row.next_id)
                self._pick(row, logits[i])

    def _pick(self, live: _Live, logits: Tensor) -> None:
        """Sample live's next token from its logits (V,), send it, and end the request where it stops."""
        request = live.request
        if request.observe is not None:
            request.observe(logits)
        token = int(sample_next(logits[None], request.sampling, live.generator)[0])
        live.said += 1
        if token in request.stop_ids:
            self._finish(live, "stop", live.text.end() if live.text is not None else "", token)
            return
        logprob: float | None = None
        top: tuple[tuple[int, float], ...] = ()
        if request.logprobs is not None:
            logp = torch.log_softmax(logits.float(), dim=-1)
            logprob = float(logp[token])
            if request.logprobs:
                values, ids = torch.topk(logp, request.logprobs)
                top = tuple(zip(ids.tolist(), values.tolist(), strict=True))
        text = live.text.push(token) if live.text is not None else ""
        stopped = live.text is not None and live.text.stopped
        full = self.kv.length(live.row) >= self.kv.capacity  # no room left for this token's keys
        ending = stopped or live.said >= request.max_tokens or (full and not request.slide)
        if ending and not stopped and live.text is not None:
            text += live.text.end()
        live.emit(Token(token, text, logprob, top))
        if ending:
            self._finish(live, "stop" if stopped else "length")
        elif full:  # sliding: forget the oldest tokens, read the last capacity again (as qkv.generation.stream)
            live.pending, live.next_id = (self.held[live.row] + [token])[-self.kv.capacity :], None
            self.kv.keep(live.row, 0)
            self.held[live.row] = []
        else:
            live.next_id = token

    def _finish(self, live: _Live, reason: FinishReason, text: str = "", stop_id: int | None = None) -> None:
        """Send Finished and free live's slot (its keys stay, for a prompt that starts the same way)."""
        if live.row >= 0 and self.rows[live.row] is live:
            self.rows[live.row] = None
        live.emit(Finished(reason, len(live.request.ids), live.said, live.cached, text, stop_id))


def _collect(tokens: list[Token], done: list[Finished], k: int,
             on_event: Callable[[int, Event], None] | None) -> Callable[[Event], None]:  # fmt: skip
    """An emit that keeps tokens and the end in lists, and shows each event to on_event as request k's."""

    def emit(event: Event) -> None:
        (tokens if isinstance(event, Token) else done).append(event)  # type: ignore[arg-type]
        if on_event is not None:
            on_event(k, event)

    return emit


__all__ = ["Busy", "Closed", "Engine", "Handle", "slots_for"]
