"""The explorer's web server: Starlette routes over qkv.explore's panels, served by uvicorn on 127.0.0.1.

The page and its scripts come from this package (static/); nothing is fetched from anywhere else.
Requests whose Host header is not the address being served are refused (no DNS rebinding), and every
refusal is a 4xx with a one-line JSON error: {"error": "..."}.
"""

from __future__ import annotations

import ipaddress
import json
import os
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
from qkv.io.sockets import bind_socket, parse_host

STATIC = Path(__file__).parent / "static"
MAX_BODY = 1 << 20  # bytes: the largest request the page sends is a table of numbers
MAX_DRAINED = 16 << 20  # bytes of a too-large request read and dropped before answering 413
# The page runs its own scripts and calls its own server, nothing else: an injected <script> or a request to
# another host is refused by the browser too (the page sets colours through style attributes, hence 'unsafe-inline').
PAGE_POLICY = (
    "default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; img-src 'self' data:; "
    "connect-src 'self'; object-src 'none'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)


class HostCheck:
    """ASGI middleware: 403 unless the Host header names this server, and for a POST, unless it comes from the page.

    A page on another site can make the browser send requests here: DNS rebinding gives them a foreign
    Host header, and a cross-site form or fetch carries a foreign Origin (or a non-JSON content type,
    which a cross-site request can send without asking first). All three are refused.
    """

    def __init__(self, app: ASGIApp, host: str, port: int) -> None:
        self.app = app
        self.port = port
        self.allowed = allowed_hosts(host, port)
        self.any_address = ipaddress.ip_address(host).is_unspecified  # --host 0.0.0.0: every interface

    def host_ok(self, host: str) -> bool:
        """Whether a Host header names this server: one of its names, or any IP address when it listens on all."""
        if host in self.allowed:
            return True
        name, _, port = host.rpartition(":")
        try:
            return self.any_address and port == str(self.port) and bool(ipaddress.ip_address(name.strip("[]")))
        except ValueError:
            return False

    def refusal(self, method: str, headers: dict[str, str]) -> tuple[int, str] | None:
        """(status, reason) when a request does not come from the explorer's own page, else None."""
        host = headers.get("host", "").lower()
        origin = headers.get("origin")
        if not self.host_ok(host):
            return 403, f"Host {host!r} is not the address this explorer serves"
        if origin is not None and origin.lower() != f"http://{host}":
            return 403, f"requests from {origin!r} are refused: only the explorer's own page may call it"
        if method == "POST" and headers.get("content-type", "").split(";")[0].strip() != "application/json":
            return 415, "send the request as application/json"
        return None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Pass allowed requests on; refuse the others before any route runs."""
        if scope["type"] == "http":
            headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
            refused = self.refusal(scope["method"], headers)
            if refused is not None:
                await JSONResponse({"error": refused[1]}, refused[0])(scope, receive, send)
                return
        await self.app(scope, receive, send)


def allowed_hosts(host: str, port: int) -> set[str]:
    """The Host headers that name this server: its address and port (and localhost when it listens on loopback)."""
    names = {host}
    address = ipaddress.ip_address(host)
    if address.is_loopback or address.is_unspecified:  # 0.0.0.0 listens on loopback too
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


def _handle(name: str, library: RunLibrary, body: Body) -> dict[str, Any]:
    """Run the POST route `name` of qkv.explore.routes (imported on first use: it loads torch)."""
    from qkv.explore import routes

    if name not in routes.POSTS:
        raise RequestError(404, f"no API route {name!r}; the routes are: {', '.join(routes.POSTS)}")
    return routes.POSTS[name](library, body)


def api(library: RunLibrary) -> Callable[[Request], Awaitable[Response]]:
    """POST /api/NAME: the JSON body checked into a Body, route NAME run off the event loop, its dict as JSON."""

    async def endpoint(request: Request) -> Response:
        """Read at most MAX_BODY bytes of JSON, answer with the route's dict (non-finite numbers refused)."""
        raw, size = bytearray(), 0
        async for chunk in request.stream():
            size += len(chunk)
            if size <= MAX_BODY:
                raw += chunk
            elif size > MAX_DRAINED:  # stop listening: the connection closes
                break
        if size > MAX_BODY:  # read to the end (up to MAX_DRAINED), so that the client gets this answer, not a reset
            return _error(413, f"the request is larger than {MAX_BODY:,} bytes")
        try:
            payload = json.loads(bytes(raw) or b"{}")
        except (ValueError, RecursionError) as err:  # RecursionError: arrays nested thousands deep
            return _error(400, f"malformed JSON: {str(err)[:200]}")
        if not isinstance(payload, dict):
            return _error(400, "the request must be a JSON object")
        answer = await run_in_threadpool(_handle, request.path_params["name"], library, Body(payload))
        try:
            content = json.dumps(answer, allow_nan=False, separators=(",", ":"))
        except ValueError:
            return _error(400, "the numbers overflow (a result is not finite); use smaller values")
        return Response(content, media_type="application/json")

    return endpoint


def create_app(library: RunLibrary) -> Starlette:
    """The explorer's routes (the page, its static files, the panels' JSON API) over a run library."""

    async def index(request: Request) -> Response:
        """The page."""
        return FileResponse(
            STATIC / "index.html", headers={"Cache-Control": "no-cache", "Content-Security-Policy": PAGE_POLICY}
        )

    async def runs(request: Request) -> Response:
        """The runs the page may open."""
        from qkv.explore import routes

        return JSONResponse(await run_in_threadpool(routes.runs, library))

    return Starlette(
        routes=[
            Route("/", index),
            Route("/api/runs", runs),
            Route("/api/{name}", api(library), methods=["POST"]),
            Mount("/static", StaticFiles(directory=STATIC), name="static"),
        ],
        exception_handlers={QkvError: _on_qkv_error, HTTPException: _on_http_error},
    )


def serve(library: RunLibrary, host: str = "127.0.0.1", port: int = 0, open_browser: bool = True) -> None:
    """Serve the explorer until Ctrl-C: print the address, open the browser, warm the panels up meanwhile."""
    import uvicorn

    host = parse_host(host)
    sock = bind_socket(host, port)
    port = sock.getsockname()[1]
    shown = "127.0.0.1" if ipaddress.ip_address(host).is_unspecified else host  # where this machine's browser goes
    url = f"http://{f'[{shown}]' if ':' in shown else shown}:{port}/"
    app = HostCheck(create_app(library), host, port)
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

    try:
        routes.warm_up(library)
    except QkvError as err:  # the page reports it too, when it asks for the run
        print(f"qkv explore: {err}", file=sys.stderr, flush=True)
