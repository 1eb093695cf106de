"""A TCP proxy between a gRPC client and the sidecar that can break the client's connections.

``cut()`` closes every client-side socket now. With ``keep_upstream=True`` (a network partition
between client and load balancer) the proxy keeps reading and discarding what the server sends,
so the server never learns the client left and finishes the turn; with ``keep_upstream=False``
it closes the server side too, and the server sees the connection drop (it cancels the turn).
New connections after a cut are proxied normally, to ``upstream`` (which a test may point at a
restarted server); one the server refuses is closed.
"""

from __future__ import annotations

import socket
import threading


class TcpProxy:
    def __init__(self, upstream_port: int, host: str = "127.0.0.1"):
        self.upstream = (host, upstream_port)
        self._listener = socket.create_server((host, 0))
        self.port = self._listener.getsockname()[1]
        self._pairs: list[tuple[socket.socket, socket.socket, threading.Event]] = []
        self._drained: list[socket.socket] = []
        self._lock = threading.Lock()
        self._closed = False
        self.connections = 0
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(self.upstream)
            except OSError:  # the server is down (a restart): the client sees its connection drop
                _close(client)
                continue
            cut = threading.Event()
            with self._lock:
                self._pairs.append((client, upstream, cut))
                self.connections += 1
            threading.Thread(target=self._pump, args=(client, upstream, cut, False), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, cut, True), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket, cut: threading.Event, from_server: bool) -> None:
        while True:
            try:
                data = src.recv(65536)
            except OSError:
                return
            if not data:
                if not cut.is_set():
                    _close(dst)
                return
            if cut.is_set():
                if from_server:
                    continue  # drain: the server keeps writing into the void
                return
            try:
                dst.sendall(data)
            except OSError:
                if not from_server:
                    return

    def cut(self, keep_upstream: bool = True) -> int:
        """Break every open connection; returns how many."""
        with self._lock:
            pairs, self._pairs = self._pairs, []
        for client, upstream, cut in pairs:
            cut.set()
            _close(client)
            if keep_upstream:
                self._drained.append(upstream)
            else:
                _close(upstream)
        return len(pairs)

    def close(self) -> None:
        self._closed = True
        _close(self._listener)
        with self._lock:
            pairs, self._pairs = self._pairs, []
        for client, upstream, cut in pairs:
            cut.set()
            _close(client)
            _close(upstream)
        for upstream in self._drained:
            _close(upstream)


def _close(s: socket.socket) -> None:
    try:
        s.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    try:
        s.close()
    except OSError:
        pass
