"""A conversation with a model: the history, the system message, the prompt the template renders from them, and
the reply streamed token by token by the engine (qkv.engine, one slot) until the end-of-turn token.

When the rendered history and the room for a reply no longer fit the model's context, the oldest exchanges are
dropped (the system message stays), and the session says how many; a single message too long to fit is refused.

The KV cache outlives a turn. Each prompt re-renders the whole conversation, but its keys and values up to the
end of the last reply are already cached, so a turn reads only its new tokens (the end of the last turn, the
user's message, the assistant's header), as llama.cpp's server reuses a prompt's cached prefix: the engine keeps
a finished slot's keys, and a prompt that starts with what the slot holds reads only the rest.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field

from qkv.chat.data import end_of_turn
from qkv.chat.template import ChatTemplate, Message
from qkv.engine import Engine, Event, Finished, Request, Token
from qkv.engine.samples import end_of_text
from qkv.errors import QkvError
from qkv.generation import Sampling
from qkv.models import DecoderLM
from qkv.tokenizers import Tokenizer


def stop_ids(tokenizer: Tokenizer) -> set[int]:
    """Tokens that end a reply: the end-of-turn marker and end-of-text."""
    eot = end_of_turn(tokenizer)
    return set(end_of_text(tokenizer)) | ({tokenizer.encode(eot)[0]} if eot is not None else set())


@dataclass
class ChatSession:
    """A model, its tokenizer and template, and the conversation so far."""

    model: DecoderLM
    tokenizer: Tokenizer
    template: ChatTemplate
    sampling: Sampling = field(default_factory=Sampling)
    max_new_tokens: int = 256
    system: str | None = None  # None: the template's own default, if it has one
    history: list[Message] = field(default_factory=list)
    dropped: int = 0  # exchanges dropped from the front so far, to fit the context
    reuse_cache: bool = True  # keep the KV cache across turns: a turn reads only what its prompt adds
    compiled: bool = False  # one-token steps compiled (qkv.generation.compiled_step); read, as reuse_cache is, once
    _engine: Engine | None = field(default=None, init=False, repr=False)

    @property
    def engine(self) -> Engine:
        """The one-slot engine that generates the replies (made at the first reply; its slot keeps the keys)."""
        if self._engine is None:
            self._engine = Engine(self.model, self.tokenizer, max_batch=1, reuse_prompts=self.reuse_cache,
                                  compiled=self.compiled)  # fmt: skip
        return self._engine

    def reset(self) -> None:
        """Forget the conversation (the system message stays)."""
        self.history, self.dropped = [], 0

    def messages(self) -> list[Message]:
        """The system message (if set) and the history."""
        head = [{"role": "system", "content": self.system}] if self.system is not None else []
        return head + self.history

    def prompt(self) -> tuple[list[int], int]:
        """The rendered conversation's ids, ready for the reply, and how many exchanges were dropped to fit."""
        limit = self.model.cfg.context_length - self.max_new_tokens
        dropped = 0
        while True:
            ids = self.tokenizer.encode(self.template.render(self.messages(), add_generation_prompt=True))
            if len(ids) <= limit:
                return ids, dropped
            if len(self.history) <= 1:
                raise QkvError(f"the message is {len(ids)} tokens with the template; the model reads "
                               f"{self.model.cfg.context_length}, {self.max_new_tokens} of them kept for the reply: "
                               "shorten it, or lower --max-new-tokens")  # fmt: skip
            cut = next((i for i in range(1, len(self.history)) if self.history[i]["role"] == "user"),
                       len(self.history) - 1)  # fmt: skip
            self.history, dropped = self.history[cut:], dropped + 1

    def say(self, text: str) -> tuple[Iterator[int], int]:
        """Add the user's message; the reply's tokens as a generator, and how many exchanges were dropped to fit.

        The reply joins the history when the generator ends, also when it is closed early (Ctrl-C): what was said
        so far is what the model said.
        """
        self.history.append({"role": "user", "content": text})
        try:
            ids, dropped = self.prompt()
        except QkvError:
            self.history.pop()
            raise
        self.dropped += dropped
        return self._reply(ids), dropped

    def _reply(self, ids: list[int]) -> Iterator[int]:
        """Stream the reply's tokens (stop tokens excluded), then record it."""
        request = Request(ids, self.max_new_tokens, self.sampling, frozenset(stop_ids(self.tokenizer)))
        events: deque[Event] = deque()
        handle, said, done = self.engine.submit(request, events.append), [], False
        try:
            while not done:
                self.engine.step()
                while events:
                    event = events.popleft()
                    if isinstance(event, Finished):
                        done = True
                    elif isinstance(event, Token):
                        said.append(event.id)
                        yield event.id
        finally:
            if not done:  # closed early (Ctrl-C): end the request, keep the keys of what was read
                handle.cancel()
                self.engine.step()
            self.history.append({"role": "assistant", "content": self.tokenizer.decode(said)})
