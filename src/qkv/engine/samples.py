"""Continuations of one prompt, sampled through the engine: what `qkv generate` and a run's `generate` print.

They run past the model's context as qkv.generation.stream does (the oldest tokens are forgotten and the last
context's worth read again), and sample k of n draws with seed + k, so that any one sample can be repeated alone.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from qkv.engine.engine import Engine
from qkv.engine.requests import Event, Request, Token
from qkv.engine.rows import slottable
from qkv.generation import Sampling
from qkv.models import DecoderLM
from qkv.tokenizers import Tokenizer


def continuations(model: DecoderLM, tokenizer: Tokenizer, prompt: list[int], max_tokens: int, sampling: Sampling,
                  n: int = 1, *, compiled: bool = False,
                  show: Callable[[str], None] | None = None) -> list[list[int]]:  # fmt: skip
    """n continuations of `prompt`'s ids, up to end-of-text or max_tokens each; show(text) gets the first one's text
    as it comes. Decoded together where the model's caches allow (not compiled), else one after another."""
    if max_tokens == 0:
        return [[] for _ in range(n)]
    together = n if n > 1 and not compiled and slottable(model) else 1
    engine = Engine(model, tokenizer, max_batch=together, max_queue=n, compiled=compiled)
    stops = frozenset() if tokenizer.eos_id is None else frozenset({tokenizer.eos_id})
    tokens: list[list[int]] = [[] for _ in range(n)]
    ended = [False] * n

    def collect(k: int) -> Callable[[Event], None]:
        def emit(event: Event) -> None:
            if isinstance(event, Token):
                tokens[k].append(event.id)
            else:
                ended[k] = True
            if k == 0 and show is not None:
                show(event.text)

        return emit

    for k in range(n):
        seeded = sampling if sampling.seed is None else replace(sampling, seed=sampling.seed + k)
        engine.submit(Request(prompt, max_tokens, seeded, stops, slide=True), collect(k))
    while not all(ended):
        engine.step()
    return tokens


__all__ = ["continuations"]
