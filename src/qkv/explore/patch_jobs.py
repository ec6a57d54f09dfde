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

from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor

from qkv.errors import QkvError
from qkv.explore.inside import device_of, prompt_ids, single_stack
from qkv.explore.jobs import ABANDONED_S, START_WAIT_S, Job, Jobs, Steps
from qkv.interpret.patching import Row, plan_patching
from qkv.models import DecoderLM

MAX_PATCH_TOKENS = 32  # each layer's pass runs T copies of a T-token prompt: the work grows as L × T²
# Parameters × tokens a whole map may run through the model (~2 FLOPs each): ten times SmolLM2-135M's map of
# "The capital of France is"; longer prompts on large models are refused up front, before any work.
MAX_PATCH_WORK = 2e12


def map_steps(rows: Iterator[Row]) -> Steps:
    """A job's steps from a plan's rows: after each forward pass, the map's rows so far {resid, heads}."""
    resid: list[list[float]] = []
    heads: list[list[float]] = []
    for kind, _, effects in rows:
        (resid if kind == "resid" else heads).append([float(v) for v in effects])
        yield {"resid": list(resid), "heads": list(heads)}


class PatchJobs(Jobs):
    """Patching maps, one computed at a time; a job's steps are a plan's rows (kind, layer, effects)."""

    def __init__(self, running: int = 1, wait_s: float = START_WAIT_S, abandoned_s: float = ABANDONED_S) -> None:
        super().__init__("patching map", running, wait_s, abandoned_s)

    def start_map(self, prepare: Callable[[], tuple[int, Iterator[Row]]]) -> Job:
        """Start a map: prepare() gives (total rows, rows); the job's view starts empty."""

        def steps() -> tuple[int, Steps]:
            total, rows = prepare()
            return total, map_steps(rows)

        return self.start(steps, {"resid": [], "heads": []})


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

    job = jobs.start_map(prepare)
    p = chosen["plan"]
    return {"job": job.id, "total": job.total, "n_layers": p.n_layers, "n_heads": p.n_heads, "heads": heads,
            "clean_tokens": [tokenizer.decode([i]) for i in clean_ids],
            "corrupted_tokens": [tokenizer.decode([i]) for i in corrupted_ids],
            "answer": {"id": p.answer, "text": tokenizer.decode([p.answer])},
            "wrong": {"id": p.wrong, "text": tokenizer.decode([p.wrong])},
            "clean": p.clean, "corrupted": p.corrupted_metric}  # fmt: skip
