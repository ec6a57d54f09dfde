"""Continuations of one prompt, sampled through the engine: what `qkv generate` and a run's `generate` print.

They run past the model's context as qkv.generation.stream does (the oldest tokens are forgotten and the last
context's worth read again), and sample k of n draws with seed + k, so that any one sample can be repeated alone.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from qkv.engine.engine import Engine
from qkv.engine.requests import Event, Request
from qkv.engine.rows import together
from qkv.generation import Sampling
from qkv.models import DecoderLM
from qkv.tokenizers import Tokenizer


def end_of_text(tokenizer: Tokenizer) -> frozenset[int]:
    """The tokens that end a continuation of plain text: end-of-text, where the tokenizer has one."""
    return frozenset() if tokenizer.eos_id is None else frozenset({tokenizer.eos_id})


def seeded(sampling: Sampling, k: int) -> Sampling:
    """The sampling of draw k: seed + k where a seed is given (draws differ, and each repeats alone)."""
    return sampling if sampling.seed is None else replace(sampling, seed=sampling.seed + k)


def continuations(model: DecoderLM, tokenizer: Tokenizer, prompt: list[int], max_tokens: int, sampling: Sampling,
                  n: int = 1, *, compiled: bool = False,
                  show: Callable[[str], None] | None = None) -> list[list[int]]:  # fmt: skip
    """n continuations of `prompt`'s ids, up to end-of-text or max_tokens each; show(text) gets the first one's text
    as it comes. Decoded together where the model's caches allow, else one after another."""
    if max_tokens == 0:
        return [[] for _ in range(n)]
    batch = together(model, n)
    room = min(model.cfg.context_length, len(prompt) + max_tokens)  # a slot never holds more than it may need
    engine = Engine(model, tokenizer, max_batch=batch, kv_cache_tokens=batch * room, max_queue=n, compiled=compiled)
    requests = [Request(prompt, max_tokens, seeded(sampling, k), end_of_text(tokenizer), slide=True) for k in range(n)]

    def first(k: int, event: Event) -> None:
        if k == 0 and show is not None:
            show(event.text)

    return [[t.id for t in tokens] for tokens, _ in engine.generate(requests, first)]


__all__ = ["continuations", "end_of_text", "seeded"]
