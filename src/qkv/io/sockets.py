"""Listening sockets for qkv's servers (the explorer, `qkv serve`): an address checked, a port bound or refused."""

from __future__ import annotations

import ipaddress
import socket

from qkv.errors import QkvError


def parse_host(host: str) -> str:
    """--host as a bare IP address ("localhost" is 127.0.0.1; [::1] loses its brackets), or a one-line error."""
    host = "127.0.0.1" if host.lower() == "localhost" else host.strip().removeprefix("[").removesuffix("]")
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        raise QkvError(f"--host must be an IP address such as 127.0.0.1 or 0.0.0.0, got {host!r}") from None


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket on host:port (port 0: any free port), or a one-line error."""
    family = socket.AF_INET6 if ipaddress.ip_address(host).version == 6 else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as err:
        sock.close()
        raise QkvError(f"cannot listen on {host}:{port} ({err.strerror}); choose another --port") from None
    sock.listen(128)
    return sock


def is_loopback(host: str) -> bool:
    """Whether an address (as parse_host returns it) is reachable from this machine alone."""
    return ipaddress.ip_address(host).is_loopback


__all__ = ["bind_socket", "is_loopback", "parse_host"]
