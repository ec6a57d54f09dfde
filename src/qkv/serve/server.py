"""Run the application under uvicorn until Ctrl-C or SIGTERM, then end in-flight requests cleanly."""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import signal
import socket
import threading
from collections.abc import Iterator
from typing import Any

from qkv.serve.app import Served, create_app, run_engine


def run(served: Served, sock: socket.socket) -> None:
    """Serve on a bound socket until Ctrl-C or SIGTERM: uvicorn in a thread, the engine
    on this one (run_engine says why). On the signal, in-flight requests are ended with a 503 (streams: an error
    event, then [DONE]), then uvicorn stops."""
    import uvicorn

    host, port = sock.getsockname()[:2]
    shown = "127.0.0.1" if ipaddress.ip_address(host).is_unspecified else f"[{host}]" if ":" in host else host
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    server = uvicorn.Server(uvicorn.Config(create_app(served), log_level="info", lifespan="off",
                                           timeout_graceful_shutdown=10))  # fmt: skip
    web = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="qkv-http", daemon=True)
    print(f"qkv serve: {served.name} on http://{shown}:{port}/  (OpenAI API under /v1; Ctrl-C stops it)", flush=True)
    try:
        with _stop_on_signals(served.closing):
            web.start()
            run_engine(served.engine, served.closing)  # returns once closing is set and every request has ended
    finally:
        served.closing.set()
        server.should_exit = True
        web.join(timeout=30)
        sock.close()


@contextlib.contextmanager
def _stop_on_signals(closing: threading.Event) -> Iterator[None]:
    """Ctrl-C and SIGTERM set `closing` (the engine then ends every request and returns) instead of raising."""

    def stop(signum: int, frame: Any) -> None:
        closing.set()

    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


__all__ = ["run"]
