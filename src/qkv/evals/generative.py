"""Benchmarks where the model writes its answer: greedy generation through the engine, as lm-evaluation-harness's
`generate_until` does it, read afterwards by qkv.evals.answers.

- the prompt keeps its last (context − max_tokens) tokens where it is longer (lm-eval's left truncation);
- greedy decoding until end-of-text or end-of-turn, a stop string or max_tokens;
- the output is its tokens decoded alone, special tokens left out, and cut before the first stop string.

What it does differently: the prompts decode together in one engine (continuous batching), and a prompt that starts
as an earlier one did (a few-shot context) reads only what follows the shared start.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from qkv.chat.session import stop_ids
from qkv.engine import Engine, Event, Finished, Request
from qkv.engine.rows import together
from qkv.errors import QkvError
from qkv.evals.answers import Generation
from qkv.generation import GREEDY
from qkv.models import DecoderLM
from qkv.tokenizers import Tokenizer


def generate_answers(model: DecoderLM, tokenizer: Tokenizer, prompts: Sequence[str], generation: Generation,
                     batch: int = 32, progress: Callable[[int], None] | None = None) -> list[str]:  # fmt: skip
    """Each prompt's greedy output, decoded `batch` at a time by the engine (one at a time where the model's caches
    have no slots); progress(done) after each one ends."""
    context = model.cfg.context_length
    keep = context - generation.max_tokens  # prompt tokens that leave room for the whole answer
    if keep < 1:
        raise QkvError(f"the model reads {context} tokens, no more than the {generation.max_tokens} the answers may "
                       "take; it cannot be scored on this benchmark")  # fmt: skip
    ids = [tokenizer.encode(p)[-keep:] for p in prompts]
    batch = together(model, max(1, min(batch, len(ids))))
    room = min(context, max(len(i) for i in ids) + generation.max_tokens)
    engine = Engine(model, tokenizer, max_batch=batch, kv_cache_tokens=batch * room, max_queue=len(ids))
    stops = frozenset(stop_ids(tokenizer))  # end-of-text and end-of-turn, as lm-eval stops at the model's eos ids
    ended = 0

    def count(_: int, event: Event) -> None:
        nonlocal ended
        if isinstance(event, Finished) and progress is not None:
            ended += 1
            progress(ended)

    results = engine.generate([Request(i, generation.max_tokens, GREEDY, stops, generation.until) for i in ids], count)
    return [_read(tokenizer, [t.id for t in tokens], generation.until) for tokens, _ in results]


def _read(tokenizer: Tokenizer, tokens: list[int], until: Sequence[str]) -> str:
    """The output as lm-eval reads it: the tokens decoded alone, special ones left out, cut at each stop string."""
    special = tokenizer.special_ids()
    text = tokenizer.decode([t for t in tokens if t not in special])
    for stop in until:
        text = text.split(stop)[0]
    return text


__all__ = ["generate_answers"]
