"""`qkv serve`'s web application: OpenAI's endpoints and a chat page over one engine (qkv.engine), in Starlette.

The engine steps on the main thread (run_engine) while uvicorn's event loop runs in another; each HTTP request
submits to the engine and awaits its events on an asyncio queue that the engine's thread fills. A client that
disconnects cancels its request, which frees its slot at the next step.
Every refusal is a 4xx in OpenAI's error shape.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from qkv.engine import Busy, Closed, Engine, Event, Finished, Handle, Token
from qkv.errors import QkvError
from qkv.serve.openai import BadRequest, Call, Reply, UnknownModel, error_body, messages_of, parse, prompt_of

STATIC = Path(__file__).parent / "static"
RETRY_AFTER_S = 2  # what a 429 asks a client to wait
MAX_BODY = 4 << 20  # bytes: a long conversation fits many times over
DISCONNECT_CHECK_S = 0.5  # how often a non-streamed request looks whether its client is still there
LOG = logging.getLogger("qkv.serve")


@dataclass
class Served:
    """What the application serves: an engine over a model, with its name, and how prompts become ids."""

    engine: Engine
    name: str
    encode_chat: Callable[[list[dict[str, str]]], list[int]] | None  # None: the model has no chat template
    encode_text: Callable[[str], list[int]]
    token_text: Callable[[int], str]
    token_bytes: Callable[[int], bytes]
    chat_stop_ids: frozenset[int]
    text_stop_ids: frozenset[int]
    api_key: str | None = None
    closing: threading.Event = field(default_factory=threading.Event)


def run_engine(engine: Engine, closing: threading.Event) -> None:
    """Step the engine while it has work, until closing; then end every request left. A failing step fails its
    requests, not the server.

    Run it on the main thread, the one that loaded the model: PyTorch's OpenMP workers then form one team, which
    waits for the next operation by spinning. A second thread running operations starts a second team, and with
    more workers than cores both sleep between operations, and every small operation pays a wake-up
    (docs/serving.md measures it).
    """
    while not closing.is_set():
        if not engine.busy():
            engine.wait(0.1)
            continue
        _step(engine)
    engine.close()  # from now on submit refuses (503), so the drain below ends
    while engine.busy():
        engine.cancel_all()  # also what was submitted just before close
        _step(engine)


def _step(engine: Engine) -> None:
    """One engine step; a failing step ends its requests with an error, not the server."""
    try:
        engine.step()
    except Exception:  # a bug in a step must not leave clients waiting forever
        LOG.exception("a generation step failed; its requests are ended")
        engine.abort()


class KeyCheck:
    """ASGI middleware: with an API key, /v1/ requests must carry it as `Authorization: Bearer KEY` (else 401)."""

    def __init__(self, app: ASGIApp, key: str | None) -> None:
        self.app, self.key = app, key

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Refuse /v1/ requests without the key; pass the rest on."""
        if self.key is not None and scope["type"] == "http" and scope["path"].startswith("/v1/"):
            headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
            given = headers.get("authorization", "").removeprefix("Bearer ").strip()
            if not hmac.compare_digest(given.encode(), self.key.encode()):
                body = error_body("a valid API key is needed: send `Authorization: Bearer KEY`",
                                  "authentication_error", code="invalid_api_key")  # fmt: skip
                await JSONResponse(body, 401)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _error(status: int, message: str, param: str | None = None, headers: dict[str, str] | None = None) -> Response:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return JSONResponse(error_body(message, kind, param), status, headers=headers)


async def _on_qkv_error(request: Request, exc: Exception) -> Response:
    if isinstance(exc, UnknownModel):
        return JSONResponse(error_body(str(exc), "invalid_request_error", "model", "model_not_found"), 404)
    if isinstance(exc, TooLarge):
        return _error(413, str(exc))
    if isinstance(exc, Busy):
        return _error(429, str(exc), headers={"Retry-After": str(RETRY_AFTER_S)})
    if isinstance(exc, Closed):
        return _error(503, str(exc), headers={"Retry-After": str(RETRY_AFTER_S)})
    return _error(400, str(exc), exc.param if isinstance(exc, BadRequest) else None)


async def _on_http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    return _error(exc.status_code, str(exc.detail))


class TooLarge(QkvError):
    """A body past MAX_BODY: a 413."""


async def _body(request: Request) -> Any:
    """The JSON body, read up to MAX_BODY bytes (a larger one is refused without reading the rest)."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > MAX_BODY:
        raise TooLarge(f"the body is {int(declared)} bytes; this server reads at most {MAX_BODY}")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY:
            raise TooLarge(f"the body is over {MAX_BODY} bytes, the most this server reads")
        chunks.append(chunk)
    try:
        return json.loads(b"".join(chunks))
    except (ValueError, RecursionError):  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise BadRequest("the body is not valid JSON (or nested too deeply)") from None


def _submit(served: Served, call: Call) -> tuple[asyncio.Queue[Event], Handle]:
    """Hand call's request to the engine; its events arrive on the returned queue."""
    loop = asyncio.get_running_loop()
    events: asyncio.Queue[Event] = asyncio.Queue()

    def emit(event: Event) -> None:
        loop.call_soon_threadsafe(events.put_nowait, event)

    handle = served.engine.submit(call.request, emit)
    return events, handle


def _ended(served: Served, done: Finished) -> Response | None:
    """The error response for a request the server ended (timeout, shutdown, a failed step), else None."""
    if done.reason == "timeout":
        return _error(408, "the request ran past the server's --timeout; ask for fewer tokens or retry")
    if done.reason == "cancelled" and served.closing.is_set():
        return _error(503, "the server is shutting down", headers={"Retry-After": str(RETRY_AFTER_S)})
    if done.reason == "error":
        return _error(500, "generation failed on the server; its log says why")
    return None


async def _complete(served: Served, request: Request, call: Call, events: asyncio.Queue[Event],
                    handle: Handle) -> Response:  # fmt: skip
    """Run a submitted call to its end and answer with the whole response (cancelled if the client leaves)."""
    reply = Reply(call, served.name, served.token_text, served.token_bytes)
    checked = time.monotonic()
    try:
        while True:
            try:
                event = await asyncio.wait_for(events.get(), DISCONNECT_CHECK_S)
            except asyncio.TimeoutError:
                event = None
            if time.monotonic() - checked >= DISCONNECT_CHECK_S:
                checked = time.monotonic()
                if await request.is_disconnected():
                    return Response(status_code=499)  # nobody reads it; finally frees the slot
            if isinstance(event, Token):
                reply.add(event)
            elif event is not None:
                return _ended(served, event) or JSONResponse(reply.response(event))
    finally:
        handle.cancel()  # a no-op once finished; ends it if this task was cancelled


async def _stream(served: Served, call: Call, events: asyncio.Queue[Event], handle: Handle) -> AsyncIterator[str]:
    """Server-sent events of a submitted call: a chunk per token, the finish, the usage if asked for, then [DONE]."""
    reply = Reply(call, served.name, served.token_text, served.token_bytes)
    first = call.kind == "chat"
    try:
        if first:
            yield _sse(reply.chunk(None, first=True))
        while True:
            event = await events.get()
            if isinstance(event, Token):
                reply.add(event)
                yield _sse(reply.chunk(event))
                continue
            failed = _ended(served, event)
            if failed is not None:
                yield f"data: {bytes(failed.body).decode()}\n\n"
            else:
                yield _sse(reply.chunk(None, event))
                if call.include_usage:
                    yield _sse(reply.usage_chunk(event))
            yield "data: [DONE]\n\n"
            return
    finally:
        handle.cancel()  # the client left: free the slot


def _sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def create_app(served: Served) -> ASGIApp:
    """The ASGI application: /v1/chat/completions, /v1/completions, /v1/models, /health and the chat page at /."""

    async def completions(request: Request, kind: str) -> Response:
        body = await _body(request)
        if kind == "chat":
            if served.encode_chat is None:
                raise BadRequest(f"{served.name} has no chat template; use /v1/completions, or restart `qkv serve` "
                                 "with --chat-template FILE", "messages")  # fmt: skip
            encode, stops = served.encode_chat, served.chat_stop_ids
            read: Callable[[Any], list[int]] = lambda m: encode(messages_of(m))  # noqa: E731
        else:
            text, stops = served.encode_text, served.text_stop_ids
            read = lambda p: text(prompt_of(p))  # noqa: E731
        # Rendering and tokenizing a long prompt takes a while: off the event loop, so streams keep flowing.
        call = await run_in_threadpool(parse, body, kind, served.name, read, stops, served.engine.kv.capacity)
        events, handle = _submit(served, call)  # before any response: a full queue is a 429, not a broken stream
        if call.stream:
            return StreamingResponse(_stream(served, call, events, handle), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"},
                                     background=BackgroundTask(handle.cancel))  # fmt: skip
        return await _complete(served, request, call, events, handle)

    async def chat(request: Request) -> Response:
        return await completions(request, "chat")

    async def text(request: Request) -> Response:
        return await completions(request, "completion")

    async def models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": served.name, "object": "model", "created": 0,
                                                         "owned_by": "qkv"}]})  # fmt: skip

    async def health(request: Request) -> Response:
        state = "closing" if served.closing.is_set() else "ok"
        return JSONResponse({"status": state, "model": served.name, **served.engine.counts()})

    async def page(request: Request) -> Response:
        return FileResponse(STATIC / "chat.html", headers={"Content-Security-Policy": PAGE_POLICY})

    app = Starlette(
        routes=[Route("/v1/chat/completions", chat, methods=["POST"]), Route("/v1/completions", text, methods=["POST"]),
                Route("/v1/models", models), Route("/health", health), Route("/", page)],
        exception_handlers={QkvError: _on_qkv_error, HTTPException: _on_http_error},
    )  # fmt: skip
    return KeyCheck(app, served.api_key)


PAGE_POLICY = (
    "default-src 'self'; script-src 'self' 'unsafe-inline'; style-src 'self' 'unsafe-inline'; img-src data:; "
               "connect-src 'self'; object-src 'none'; base-uri 'none'; frame-ancestors 'none'")  # fmt: skip


__all__ = ["KeyCheck", "Served", "create_app", "run_engine"]
