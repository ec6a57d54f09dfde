"""OpenAI's API shapes: request bodies read into engine requests, engine events written as responses and chunks.

Pure functions, no web framework: app.py moves bytes, this module knows the protocol. The fields read are the ones
https://platform.openai.com/docs/api-reference/chat lists for what qkv can do; `n` > 1, tools and JSON modes are
refused with a 400 naming the field; fields that change nothing here (user, metadata, store, …) are ignored; any
other field is refused, as OpenAI refuses it, and so is a model name other than the one served (404).
"""

from __future__ import annotations

import math
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from qkv.engine import Finished, Request, Token
from qkv.errors import QkvError
from qkv.generation import Sampling

REFUSED = {  # field: when its value is refused (what qkv cannot do)
    "n": lambda v: v not in (None, 1),
    "best_of": lambda v: v not in (None, 1),
    "echo": lambda v: bool(v),
    "tools": lambda v: bool(v),
    "functions": lambda v: bool(v),
    "function_call": lambda v: v not in (None, "none"),
    "tool_choice": lambda v: v not in (None, "none", "auto"),
    "suffix": lambda v: bool(v),
    "response_format": lambda v: v not in (None, {"type": "text"}),
    "logit_bias": lambda v: bool(v),
    "presence_penalty": lambda v: v not in (None, 0, 0.0),
    "frequency_penalty": lambda v: v not in (None, 0, 0.0),
    "modalities": lambda v: v not in (None, ["text"]),
    "audio": lambda v: v is not None,
    "prediction": lambda v: v is not None,
    "reasoning_effort": lambda v: v is not None,
    "web_search_options": lambda v: v is not None,
}
IGNORED = {"user", "metadata", "store", "service_tier", "parallel_tool_calls", "prompt_cache_key", "safety_identifier"}
READ = {"model", "max_tokens", "temperature", "top_p", "stop", "seed", "stream", "stream_options", "logprobs"}
FIELDS = {  # every field each endpoint takes; any other is refused, as OpenAI refuses it
    "chat": READ | IGNORED | set(REFUSED) | {"messages", "max_completion_tokens", "top_logprobs"},
    "completion": READ | IGNORED | set(REFUSED) | {"prompt"},
}


class UnknownModel(QkvError):
    """A model name this server does not serve: a 404."""


class BadRequest(QkvError):
    """A request the API refuses: a 400 with OpenAI's error shape, naming the field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass
class Call:
    """A parsed request: the engine's request, whether to stream, and what the response includes."""

    request: Request
    kind: str  # "chat" or "completion"
    stream: bool
    include_usage: bool


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:  # fmt: skip
    """OpenAI's error object."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def _number(body: Mapping[str, Any], name: str, low: float, high: float | None = None, integer: bool = False) -> Any:
    value = body.get(name)
    if value is None:
        return None
    kinds = (int,) if integer else (int, float)
    bad = isinstance(value, bool) or not isinstance(value, kinds) or not math.isfinite(value)
    if bad or value < low or (high is not None and value > high):
        what = "an integer" if integer else "a number"
        where = f"≥ {low}" if high is None else f"in [{low}, {high}]"
        raise BadRequest(f"{name} must be {what} {where}, got {value!r}", name)
    return value


def _stops(body: Mapping[str, Any]) -> list[str]:
    stop = body.get("stop")
    stops = [stop] if isinstance(stop, str) else stop if stop is not None else []
    if not isinstance(stops, list) or len(stops) > 4 or not all(isinstance(s, str) for s in stops):
        raise BadRequest("stop must be a string or a list of up to 4 strings", "stop")
    return stops


def parse(body: Any, kind: str, model: str, encode: Callable[[Any], list[int]], stop_ids: frozenset[int],
          room: int) -> Call:  # fmt: skip
    """Read a /v1/chat/completions ("chat") or /v1/completions ("completion") body for the served `model`;
    encode(prompt or messages) gives the prompt's ids; room: the tokens a slot holds, prompt and reply."""
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object")
    unknown = sorted(set(body) - FIELDS[kind])
    if unknown:
        raise BadRequest(f"Unrecognized request argument supplied: {unknown[0]}", unknown[0])
    if body.get("model") not in (None, model):
        raise UnknownModel(f"The model `{body['model']}` does not exist; this server serves `{model}` "
                           "(GET /v1/models)")  # fmt: skip
    for name, refused in REFUSED.items():
        if refused(body.get(name)):
            raise BadRequest(f"{name}={body[name]!r} is not supported by this server", name)
    ids = encode(body.get("messages") if kind == "chat" else body.get("prompt"))
    if len(ids) >= room:
        raise BadRequest(f"the prompt is {len(ids)} tokens; a slot holds {room}, with room for the reply: shorten "
                         "it", "messages" if kind == "chat" else "prompt")  # fmt: skip
    limit = room - len(ids)
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _number(body, name, 1, integer=True)
    if max_tokens is not None and max_tokens > limit:
        raise BadRequest(f"{name}={max_tokens} does not fit: the prompt is {len(ids)} tokens and a slot holds "
                         f"{room}; ask for at most {limit}", name)  # fmt: skip
    max_tokens = max_tokens or (limit if kind == "chat" else min(16, limit))  # OpenAI's completions default: 16
    temperature = _number(body, "temperature", 0, 2)
    top_p = _number(body, "top_p", 0, 1)
    if top_p == 0:
        raise BadRequest("top_p must be in (0, 1]", "top_p")
    seed = _number(body, "seed", 0, (1 << 63) - 1, integer=True)
    sampling = Sampling(1.0 if temperature is None else float(temperature), None, top_p, seed)
    if kind == "chat":
        wanted = body.get("logprobs")
        top = _number(body, "top_logprobs", 0, 20, integer=True)
        if top is not None and not wanted:
            raise BadRequest("top_logprobs needs logprobs: true", "top_logprobs")
        logprobs = (top or 0) if wanted else None
    else:
        logprobs = _number(body, "logprobs", 0, 5, integer=True)
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise BadRequest('stream_options must be an object, such as {"include_usage": true}', "stream_options")
    if options and not body.get("stream"):
        raise BadRequest("stream_options needs stream: true", "stream_options")
    request = Request(ids, max_tokens, sampling, stop_ids, _stops(body), logprobs)
    return Call(request, kind, bool(body.get("stream")), bool(options.get("include_usage")))


def messages_of(value: Any) -> list[dict[str, str]]:
    """Chat messages as the template reads them: roles and text (text parts joined; developer is system)."""
    if not isinstance(value, list) or not value:
        raise BadRequest("messages must be a non-empty list of {role, content} objects", "messages")
    out = []
    for i, message in enumerate(value):
        if not isinstance(message, dict) or message.get("role") not in ("system", "developer", "user", "assistant"):
            raise BadRequest(f"messages[{i}] needs a role of system, developer, user or assistant", "messages")
        content = message.get("content")
        if isinstance(content, list):  # [{"type": "text", "text": …}, …]
            if not all(isinstance(p, dict) and p.get("type") == "text" for p in content):
                raise BadRequest(f"messages[{i}]: only text content parts are supported", "messages")
            content = "".join(str(p.get("text", "")) for p in content)
        if not isinstance(content, str):
            raise BadRequest(f"messages[{i}].content must be a string or a list of text parts", "messages")
        out.append({"role": "system" if message["role"] == "developer" else message["role"], "content": content})
    return out


def prompt_of(value: Any) -> str:
    """A completion's prompt: a string, or a list holding one."""
    if isinstance(value, list) and len(value) == 1:
        value = value[0]
    if not isinstance(value, str) or not value:
        raise BadRequest("prompt must be a non-empty string (one prompt per request)", "prompt")
    return value


class Reply:
    """One response being written: its id, and the tokens, text and log-probabilities so far."""

    def __init__(self, call: Call, model: str, token_text: Callable[[int], str],
                 token_bytes: Callable[[int], bytes]) -> None:  # fmt: skip
        self.call, self.model, self.token_text, self.token_bytes = call, model, token_text, token_bytes
        chat = call.kind == "chat"
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        self.created = int(time.time())
        self.object = "chat.completion" if chat else "text_completion"
        self.text: list[str] = []
        self.tokens: list[Token] = []

    def add(self, token: Token) -> None:
        """Keep a token for the whole response."""
        self.tokens.append(token)
        self.text.append(token.text)

    def usage(self, done: Finished) -> dict[str, Any]:
        """Token counts, as OpenAI reports them."""
        return {"prompt_tokens": done.prompt_tokens, "completion_tokens": done.completion_tokens,
                "total_tokens": done.prompt_tokens + done.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": done.cached_tokens}}  # fmt: skip

    def response(self, done: Finished) -> dict[str, Any]:
        """The whole (non-streamed) response."""
        text = "".join(self.text) + done.text
        choice: dict[str, Any] = {"index": 0, "finish_reason": done.reason,
                                  "logprobs": self.logprobs(self.tokens)}  # fmt: skip
        if self.call.kind == "chat":
            choice["message"] = {"role": "assistant", "content": text, "refusal": None}
        else:
            choice["text"] = text
        return {**self._head(self.object), "choices": [choice], "usage": self.usage(done)}

    def chunk(self, token: Token | None, done: Finished | None = None, first: bool = False) -> dict[str, Any]:
        """A streamed chunk: a token's text, or the end (finish_reason)."""
        tokens = [token] if token is not None else []
        text = token.text if token is not None else done.text if done is not None else ""
        choice: dict[str, Any] = {"index": 0, "finish_reason": done.reason if done else None,
                                  "logprobs": self.logprobs(tokens) if tokens else None}  # fmt: skip
        if self.call.kind == "chat":
            if first:
                choice["delta"] = {"role": "assistant", "content": text}
            else:
                choice["delta"] = {"content": text} if text or tokens else {}
            return {**self._head("chat.completion.chunk"), "choices": [choice]}
        choice["text"] = text
        return {**self._head("text_completion"), "choices": [choice]}

    def usage_chunk(self, done: Finished) -> dict[str, Any]:
        """The last chunk when stream_options.include_usage: no choices, the usage."""
        kind = "chat.completion.chunk" if self.call.kind == "chat" else "text_completion"
        return {**self._head(kind), "choices": [], "usage": self.usage(done)}

    def logprobs(self, tokens: list[Token]) -> dict[str, Any] | None:
        """Log-probabilities in the endpoint's shape (None unless asked for)."""
        if self.call.request.logprobs is None:
            return None
        if self.call.kind == "chat":
            return {"content": [{**self._entry(t.id, t.logprob), "top_logprobs": [self._entry(i, p) for i, p in t.top]}
                                for t in tokens], "refusal": None}  # fmt: skip
        offsets, at = [], len("".join(self.text[: len(self.tokens) - len(tokens)]))
        for t in tokens:
            offsets.append(at)
            at += len(t.text)
        return {"tokens": [self.token_text(t.id) for t in tokens], "token_logprobs": [t.logprob for t in tokens],
                "top_logprobs": [{self.token_text(i): p for i, p in t.top} for t in tokens],
                "text_offset": offsets}  # fmt: skip

    def _entry(self, token: int, logprob: float | None) -> dict[str, Any]:
        text = self.token_text(token)
        return {"token": text, "logprob": logprob, "bytes": list(self.token_bytes(token))}

    def _head(self, kind: str) -> dict[str, Any]:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model,
                "system_fingerprint": None}  # fmt: skip


__all__ = ["FIELDS", "REFUSED", "BadRequest", "Call", "Reply", "UnknownModel", "error_body", "messages_of", "parse",
           "prompt_of"]
