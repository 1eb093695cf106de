"""ServerThread: a SidecarServer on its own event loop in a background thread (embedding, tests).

server = ServerThread(engine, ServerOptions(port=0))
port = server.start()
...                          # call it over gRPC from this thread
server.stop()
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any, Callable

from engine.api import LLMEngine
from sidecar.grpc.options import ServerOptions
from sidecar.grpc.sidecar_server import SidecarServer
from sidecar.store.base import SessionStore
from sidecar.turns.hooks import ServerHooks


class ServerThread:
    """A SidecarServer on its own event loop in a background thread."""

    def __init__(
        self,
        engine: LLMEngine,
        options: ServerOptions | None = None,
        store: SessionStore | None = None,
        hooks: ServerHooks | None = None,
    ):
        self.server = SidecarServer(engine, options, store, hooks)
        self.loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="chainkv-server", daemon=True)

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)

        async def main():
            try:
                await self.server.start()
            except BaseException as e:
                self._error = e
                self._ready.set()
                return
            self._ready.set()
            await self.server.wait()

        self.loop.run_until_complete(main())

    def start(self) -> int:
        self._thread.start()
        self._ready.wait()
        if self._error is not None:
            raise self._error
        return self.server.port

    def run(self, coro, timeout: float | None = 60.0) -> Any:
        """Run a coroutine on the server's loop (to inspect or change its state) and return its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def call(self, fn: Callable[[], Any], timeout: float | None = 60.0) -> Any:
        """Run ``fn`` on the server's loop (its state is only safe to touch there)."""

        async def wrap():
            return fn()

        return self.run(wrap(), timeout)

    def stop(self, grace: float | None = 5.0) -> None:
        if self._thread.is_alive():
            self.run(self.server.stop(grace), timeout=None)
            self._thread.join(30)
