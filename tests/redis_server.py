"""A real redis-server for tests, on a free port in a temporary folder (never the default 6379)."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisProcess:
    """``start`` / ``stop`` a redis-server; ``stop`` (SIGTERM) saves to its folder (a save point is
    configured), so a restart keeps the data."""

    def __init__(self, folder: Path, aof: bool = False):
        if shutil.which("redis-server") is None:
            pytest.skip("redis-server is not installed")
        self.folder = Path(folder)
        self.port = free_port()
        self.aof = aof
        """Append-only file with an fsync per write: a killed server loses no acknowledged write."""
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def client(self):
        import redis

        return redis.Redis(host="127.0.0.1", port=self.port, socket_connect_timeout=2)

    def start(self) -> "RedisProcess":
        self.proc = subprocess.Popen(
            [
                "redis-server",
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--dir",
                str(self.folder),
                "--save",
                "3600 1",
                "--appendonly",
                "yes" if self.aof else "no",
                "--appendfsync",
                "always",
                "--protected-mode",
                "no",
                "--loglevel",
                "warning",
                "--enable-debug-command",
                "local",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 20
        while True:
            try:
                if self.client().ping():
                    return self
            except Exception:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"redis-server did not start on port {self.port}")
                time.sleep(0.05)

    def kill(self) -> None:
        """SIGKILL: a crash, no save on the way out (with ``aof`` the append-only file keeps the data)."""
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None

    def stop(self) -> None:
        if self.proc is None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc = None
