"""What a request to the engine asks for, and what comes back: tokens with their text, then why it ended.

Stop strings are matched in the text, not in tokens (a string can end mid-token, or span several): text that could
still be the start of a stop string is held back until the next token decides, and a matched stop string and
whatever follows it are never sent, as OpenAI's API does.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal

from torch import Tensor

from qkv.errors import QkvError
from qkv.generation import Sampling
from qkv.tokenizers.stream import TextStream

FinishReason = Literal["stop", "length", "cancelled", "timeout", "error"]
_IDS = itertools.count()


@dataclass
class Request:
    """A prompt's ids and how to continue it."""

    ids: list[int]
    max_tokens: int = 256
    sampling: Sampling = field(default_factory=Sampling)
    stop_ids: frozenset[int] = frozenset()  # tokens that end it (not sent): end-of-text, end-of-turn
    stop: Sequence[str] = ()  # strings that end it (not sent)
    logprobs: int | None = None  # None: none; 0: the chosen token's; k: and the k likeliest tokens'
    slide: bool = False  # at the context's end, go on reading its last tokens (qkv.generation.stream) instead of ending
    observe: Callable[[Tensor], None] | None = None  # sees the logits (V,) each token is sampled from
    id: int = field(default_factory=lambda: next(_IDS))
    created: float = field(default_factory=time.monotonic)

    def __post_init__(self) -> None:
        """Refuse what cannot be generated, in one line."""
        if not self.ids:
            raise QkvError("the prompt is empty: give at least one token")
        if self.max_tokens < 1:
            raise QkvError(f"max_tokens must be ≥ 1, got {self.max_tokens}")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise QkvError(f"top log-probabilities must be between 0 and 20, got {self.logprobs}")


@dataclass(frozen=True)
class Token:
    """One generated token: its id, the text it completes (may be ''), its log-probability and the top ones."""

    id: int
    text: str
    logprob: float | None = None
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class Finished:
    """The end of a request: why, how many tokens it read and wrote, and text held back until now."""

    reason: FinishReason
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0  # prompt tokens whose keys a slot already held
    text: str = ""  # what could have begun a stop string when a stop token ended the reply
    stop_id: int | None = None  # the stop token that ended the reply (not sent), if one did


Event = Token | Finished


class StopText:
    """The text of generated tokens, minus stop strings and what follows them, released as soon as it is safe."""

    def __init__(self, decode: Callable[[list[int]], str], context: list[int], stop: Sequence[str]) -> None:
        self._text = TextStream(decode, context)
        self._stop = [s for s in stop if s]
        self._held = ""  # text that could still be the start of a stop string
        self.stopped = False

    def push(self, token: int) -> str:
        """The text that is safe to send after `token`; sets `stopped` when a stop string appeared."""
        return self._release(self._held + self._text.push(token), final=False)

    def end(self) -> str:
        """What is left when generation ends (held text is sent: no stop string can complete now)."""
        return "" if self.stopped else self._release(self._held + self._text.end(), final=True)

    def _release(self, text: str, final: bool) -> str:
        hits = [i for i in (text.find(s) for s in self._stop) if i >= 0]
        if hits:
            self.stopped, self._held = True, ""
            return text[: min(hits)]
        keep = 0 if final else max((n for s in self._stop for n in range(1, len(s)) if text.endswith(s[:n])),
                                   default=0)  # fmt: skip
        self._held = text[len(text) - keep :] if keep else ""
        return text[: len(text) - keep]


__all__ = ["Event", "FinishReason", "Finished", "Request", "StopText", "Token"]
