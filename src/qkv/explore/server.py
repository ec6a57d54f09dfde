"""The explorer's web server: Starlette routes over qkv.explore's panels, served by uvicorn on 127.0.0.1.

The page and its scripts come from this package (static/); nothing is fetched from anywhere else.
Requests whose Host header is not the address being served are refused (no DNS rebinding), and every
refusal is a 4xx with a one-line JSON error: {"error": "..."}.
"""

from __future__ import annotations

import ipaddress
import json
import os
import socket
import sys
import threading
import webbrowser
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.types import ASGIApp, Receive, Scope, Send

from qkv.errors import QkvError
from qkv.explore.body import Body
from qkv.explore.library import RequestError, RunLibrary

STATIC = Path(__file__).parent / "static"
MAX_BODY = 1 << 20  # bytes: the largest request the page sends is a table of numbers


class HostCheck:
    """ASGI middleware: answer 403 unless the Host header names the address the server listens on."""

    def __init__(self, app: ASGIApp, allowed: set[str]) -> None:
        self.app = app
        self.allowed = allowed

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Pass allowed requests on; refuse the others before any route runs."""
        if scope["type"] == "http":
            host = dict(scope["headers"]).get(b"host", b"").decode("latin-1").lower()
            if host not in self.allowed:
                response = JSONResponse({"error": f"Host {host!r} is not the address this explorer serves"}, 403)
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def allowed_hosts(host: str, port: int) -> set[str]:
    """The Host headers that name this server: its address and port (and localhost when it listens on loopback)."""
    names = {host.strip("[]")}
    address = ipaddress.ip_address(host.strip("[]"))
    if address.is_loopback:
        names |= {"localhost", "127.0.0.1", "::1"}
    return {f"[{n}]:{port}" if ":" in n else f"{n}:{port}" for n in names}


def _error(status: int, message: str) -> JSONResponse:
    """A refusal as the page reads it."""
    return JSONResponse({"error": message}, status)


async def _on_qkv_error(request: Request, exc: Exception) -> Response:
    """Bad input: 400, or the status a RequestError carries."""
    return _error(exc.status if isinstance(exc, RequestError) else 400, str(exc))


async def _on_http_error(request: Request, exc: Exception) -> Response:
    """Unknown paths and wrong methods, as JSON like every other refusal."""
    assert isinstance(exc, HTTPException)
    return _error(exc.status_code, str(exc.detail))


POSTS = ("spreadsheet", "trainable", "multihead", "positions", "norms", "model", "attention", "next", "step")


def _handle(name: str, library: RunLibrary, body: Body) -> dict[str, Any]:
    """Run route `name` of qkv.explore.routes (imported on first use: it loads torch)."""
    from qkv.explore import routes

    return routes.POSTS[name](library, body)


def api(name: str, library: RunLibrary) -> Callable[[Request], Awaitable[Response]]:
    """A POST route: the JSON body checked into a Body, the handler run off the event loop, its dict as JSON."""

    async def endpoint(request: Request) -> Response:
        raw = await request.body()
        if len(raw) > MAX_BODY:
            return _error(413, f"the request is larger than {MAX_BODY:,} bytes")
        try:
            payload = json.loads(raw or b"{}")
        except ValueError as err:
            return _error(400, f"malformed JSON: {err}")
        if not isinstance(payload, dict):
            return _error(400, "the request must be a JSON object")
        return JSONResponse(await run_in_threadpool(_handle, name, library, Body(payload)))

    return endpoint


def create_app(library: RunLibrary) -> Starlette:
    """The explorer's routes (the page, its static files, the panels' JSON API) over a run library."""

    async def index(request: Request) -> Response:
        return FileResponse(STATIC / "index.html", headers={"Cache-Control": "no-cache"})

    async def runs(request: Request) -> Response:
        from qkv.explore import routes

        return JSONResponse(await run_in_threadpool(routes.runs, library))

    return Starlette(
        routes=[
            Route("/", index),
            Route("/api/runs", runs),
            *(Route(f"/api/{name}", api(name, library), methods=["POST"]) for name in POSTS),
            Mount("/static", StaticFiles(directory=STATIC), name="static"),
        ],
        exception_handlers={QkvError: _on_qkv_error, HTTPException: _on_http_error},
    )


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket on host:port (port 0: any free port), or a one-line error."""
    try:
        family = socket.AF_INET6 if ipaddress.ip_address(host.strip("[]")).version == 6 else socket.AF_INET
    except ValueError:
        raise QkvError(f"--host must be an IP address such as 127.0.0.1, got {host!r}") from None
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host.strip("[]"), port))
    except OSError as err:
        sock.close()
        raise QkvError(f"cannot listen on {host}:{port} ({err.strerror}); choose another --port") from None
    sock.listen(128)
    return sock


def serve(library: RunLibrary, host: str = "127.0.0.1", port: int = 0, open_browser: bool = True) -> None:
    """Serve the explorer until Ctrl-C: print the address, open the browser, warm the panels up meanwhile."""
    import uvicorn

    sock = bind_socket(host, port)
    port = sock.getsockname()[1]
    url = f"http://{f'[{host}]' if ':' in host else host}:{port}/"
    app = HostCheck(create_app(library), allowed_hosts(host, port))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off", access_log=False))
    print(f"qkv explore: serving {url}  (Ctrl-C stops it)", flush=True)
    threading.Thread(target=_warm_up, args=(library,), daemon=True).start()
    if open_browser and not _open(url):
        print("qkv explore: no browser to open here; open the address above in yours", flush=True)
    try:
        server.run(sockets=[sock])
    except KeyboardInterrupt:  # uvicorn re-raises the Ctrl-C it handled, once it has shut down
        pass
    finally:
        sock.close()


def _open(url: str) -> bool:
    """Open the page in the desktop's browser; False where there is none (a Linux machine without a display).

    The socket already listens, so the browser's first request waits in its queue until uvicorn serves it.
    Without a display, Python's webbrowser would fall back to a text browser in this very terminal.
    """
    if sys.platform.startswith("linux") and not (os.environ.get("DISPLAY") or os.environ.get("WAYLAND_DISPLAY")):
        return False
    try:
        return webbrowser.open(url)
    except webbrowser.Error:
        return False


def _warm_up(library: RunLibrary) -> None:
    """Import the panels (torch) and load the first run while the browser opens, so the first answers are quick."""
    from qkv.explore import routes

    routes.warm_up(library)
