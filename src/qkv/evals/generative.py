"""Benchmarks where the model writes its answer: greedy generation through the engine, as lm-evaluation-harness's
`generate_until` does it, read afterwards by qkv.evals.answers.

- the prompt keeps its last (context − max_tokens) tokens where it is longer (lm-eval's left truncation);
- greedy decoding until end-of-text, a stop string or max_tokens; the text is cut before the first stop string.

What it does differently: the prompts decode together in one engine (continuous batching), and a prompt that starts
as an earlier one did (a few-shot context) reads only what follows the shared start.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from qkv.engine import Engine, Event, Finished, Request
from qkv.errors import QkvError
from qkv.evals.answers import Generation
from qkv.generation import GREEDY
from qkv.models import DecoderLM
from qkv.tokenizers import Tokenizer


def generate_answers(model: DecoderLM, tokenizer: Tokenizer, prompts: Sequence[str], generation: Generation,
                     batch: int = 16, progress: Callable[[int], None] | None = None) -> list[str]:  # fmt: skip
    """Each prompt's greedy output, cut before its first stop string, decoded `batch` at a time by the engine;
    progress(done) after each one ends."""
    context = model.cfg.context_length
    keep = context - generation.max_tokens  # prompt tokens that leave room for the whole answer
    if keep < 1:
        raise QkvError(f"the model reads {context} tokens, no more than the {generation.max_tokens} the answers may "
                       "take; it cannot be scored on this benchmark")  # fmt: skip
    ids = [tokenizer.encode(p)[-keep:] for p in prompts]
    longest = max(len(i) for i in ids) + generation.max_tokens
    batch = max(1, min(batch, len(ids)))
    engine = Engine(model, tokenizer, max_batch=batch, kv_cache_tokens=batch * min(context, longest),
                    max_queue=len(ids))  # fmt: skip
    stops = frozenset() if tokenizer.eos_id is None else frozenset({tokenizer.eos_id})
    texts: list[list[str]] = [[] for _ in ids]
    done = [False] * len(ids)

    def collect(k: int) -> Callable[[Event], None]:
        def emit(event: Event) -> None:
            texts[k].append(event.text)
            if isinstance(event, Finished):
                done[k] = True
                if progress is not None:
                    progress(sum(done))

        return emit

    for k, prompt in enumerate(ids):
        engine.submit(Request(prompt, generation.max_tokens, GREEDY, stops, generation.until), collect(k))
    while not all(done):
        engine.step()
    return ["".join(parts) for parts in texts]


__all__ = ["generate_answers"]
