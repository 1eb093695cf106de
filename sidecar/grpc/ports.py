"""Listening ports: each one ``chainkv serve`` opens (gRPC, HTTP, metrics) is checked before the
model loads, and bound before the sidecar says it serves; a port that cannot be had is one clear
error (``PortUnavailable``), never a traceback after "serving"."""

from __future__ import annotations

import socket


class PortUnavailable(OSError):
    """A port cannot be listened on (in use, not permitted, no such address)."""


def bind(host: str, port: int, what: str) -> socket.socket:
    """A listening TCP socket on ``host:port`` (0: a free port) for ``what`` (a flag name, for the
    error); raises PortUnavailable."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a port in TIME_WAIT, as servers do
        sock.bind((host, port))
        sock.listen(128)
    except OSError as e:
        sock.close()
        raise PortUnavailable(f"{what}: cannot listen on {host}:{port}: {e.strerror or e}") from None
    return sock


def check_free(listeners: list[tuple[str, str, int | None]]) -> None:
    """Raise PortUnavailable unless every ``(what, host, port)`` (port None: not served) can be
    bound, and no two name the same fixed port."""
    seen: dict[int, str] = {}
    for what, host, port in listeners:
        if port is None or port == 0:
            continue
        if port in seen:
            raise PortUnavailable(f"{what} and {seen[port]} are both port {port}")
        seen[port] = what
        bind(host, port, what).close()
