"""SidecarServer: the sidecar's parts put together, started and stopped in order.

    server = SidecarServer(engine, ServerOptions(port=50051), open_store("redis://localhost:6379"))
    port = await server.start()
    ...
    await server.stop()          # health NOT_SERVING, drain running turns, flush snapshots

It owns one ``EngineClient`` (the engine thread), one ``SessionManager`` (the store's one owner,
given the ``SnapshotWriter`` when there is a store), the ``StoreHealth`` watch, the ``TurnRunner``, the ``SidecarService`` and
its ``GrpcEndpoint``, and a janitor that frees idle sessions whose snapshots are committed. Another
front (an HTTP app) serves the same sessions in the same process through ``server.turns``
(``TurnRunner.run_args``), ``server.sessions`` and ``server.client``.

Health is SERVING while the engine runs, the server is not draining and the store answers
(``serving``). A store that does not answer at ``start`` stops it (StoreUnavailable) unless
``ServerOptions.allow_store_down``; then, and whenever the store goes away later, health is
NOT_SERVING until it answers again.
"""

from __future__ import annotations

import asyncio
import logging
import time

from engine.api import LLMEngine
from sidecar.engine_bridge.client import EngineClient
from sidecar.grpc.endpoint import NOT_SERVING, SERVING, GrpcEndpoint
from sidecar.grpc.options import ServerOptions
from sidecar.grpc.service import SidecarService
from sidecar.sessions.janitor import janitor_loop
from sidecar.sessions.loading import StoreBehind
from sidecar.sessions.manager import SessionManager
from sidecar.sessions.snapshots import SnapshotWriter
from sidecar.store.base import SessionStore
from sidecar.store.errors import StoreUnavailable
from sidecar.store.health import StoreHealth
from sidecar.turns.chat import ChatRenderer
from sidecar.turns.hooks import ServerHooks
from sidecar.turns.runner import TurnRunner
from sidecar.turns.validation import BYTES_PER_TOKEN

log = logging.getLogger(__name__)


class SidecarServer:
    """The sidecar: gRPC server, engine thread, sessions, snapshot writer, health and reflection."""

    def __init__(
        self,
        engine: LLMEngine,
        options: ServerOptions | None = None,
        store: SessionStore | None = None,
        hooks: ServerHooks | None = None,
    ):
        self.engine = engine
        self.options = options or ServerOptions()
        self.store = store
        self.hooks = hooks or ServerHooks()
        self.client = EngineClient(engine, on_failure=self._engine_failed)
        self.renderer = ChatRenderer(self.client.tokenizer, set(self.client.eos_token_ids))
        self.endpoint = GrpcEndpoint(self.options)
        self.draining = False
        self.port: int | None = None
        self._stopped: asyncio.Event | None = None
        self.sessions: SessionManager | None = None
        self.writer: SnapshotWriter | None = None
        self.turns: TurnRunner | None = None
        self.service: SidecarService | None = None
        self._janitor: asyncio.Task | None = None
        self.store_health: StoreHealth | None = None
        self._store_watch: asyncio.Task | None = None

    # --- lifecycle ---------------------------------------------------------------------------------------
    async def start(self) -> int:
        o = self.options
        if o.limits.max_turn_bytes is None:
            o.limits.max_turn_bytes = BYTES_PER_TOKEN * self.client.model.max_model_len
        self._stopped = asyncio.Event()
        if self.store is not None:
            self.store_health = StoreHealth(
                self.store, interval_s=o.store_check_s, on_change=lambda up: self._health_changed()
            )
            if not await self.store_health.check() and not o.allow_store_down:
                raise StoreUnavailable(
                    f"the session store {self.store.describe()} cannot be reached ({self.store_health.last_error})"
                )
        self.client.start(asyncio.get_running_loop())
        self.hooks.on_start(self.client)
        if self.store is not None:
            self.writer = SnapshotWriter(
                self.store,
                self.client,
                with_kv=o.snapshot_kv,
                max_pending=o.snapshot_queue,
                retry_max_s=o.snapshot_retry_max_s,
                hooks=self.hooks,
                store_health=self.store_health,
            )
        self.sessions = SessionManager(
            self.client,
            self.store,
            writer=self.writer,
            end_of_turn_id=self.renderer.end_of_turn_id,
            idempotency_window=o.idempotency_window,
            resume_wait_s=o.resume_wait_s,
        )
        self.sessions.start()
        self.turns = TurnRunner(
            self.client,
            self.sessions,
            self.renderer,
            limits=o.limits,
            tenant_limits=o.tenant_limits,
            hooks=self.hooks,
            sync_commit=o.durability == "sync",
        )
        self.service = SidecarService(
            client=self.client,
            sessions=self.sessions,
            turns=self.turns,
            options=o,
            hooks=self.hooks,
            draining=lambda: self.draining,
        )
        self.port = await self.endpoint.start(self.service.handlers())
        if not self.serving:
            await self.endpoint.set_health(NOT_SERVING)
        if self.store_health is not None:
            self._store_watch = asyncio.create_task(self.store_health.watch(), name="chainkv-store-health")
        self._janitor = asyncio.create_task(janitor_loop(self.sessions, o, self.store_failed), name="chainkv-janitor")
        log.info(
            "chainkv sidecar: gRPC listening on %s:%d (store: %s)",
            o.host,
            self.port,
            self.store.describe() if self.store else "none",
        )
        return self.port

    @property
    def serving(self) -> bool:
        """Health SERVING: the engine runs, the server is not draining, the store (if any) answers."""
        store_up = self.store_health is None or self.store_health.up
        return not self.draining and self.client.failed is None and store_up

    def _engine_failed(self, error: BaseException) -> None:
        asyncio.ensure_future(self.endpoint.set_health(NOT_SERVING))

    def _health_changed(self) -> None:
        if self.service is not None:
            asyncio.ensure_future(self.endpoint.set_health(SERVING if self.serving else NOT_SERVING))

    def store_failed(self, error: BaseException, what: str) -> None:
        """``what`` failed because the store did not answer: logged at most once a minute, without a
        traceback (``StoreHealth.failed``). A store that is only behind a client is no outage."""
        if self.store_health is not None and not isinstance(error, StoreBehind):
            self.store_health.failed(error, what)

    async def stop(self, grace: float | None = None) -> None:
        """Graceful shutdown: NOT_SERVING, refuse new turns, let running ones finish (``grace``),
        write pending snapshots, stop."""
        if self.service is None:
            return
        grace = self.options.grace_s if grace is None else grace
        self.draining = True
        await self.endpoint.set_health(NOT_SERVING)
        if self._store_watch is not None:
            self._store_watch.cancel()
        until = time.monotonic() + grace
        while self.sessions.active_turns and time.monotonic() < until:
            await asyncio.sleep(0.05)
        await self.endpoint.stop(max(0.0, until - time.monotonic()))
        await self.turns.settle_all()
        await self.sessions.stop_writing(self.options.flush_timeout_s)
        if self._janitor is not None:
            self._janitor.cancel()
        await self.client.stop()
        self.sessions.close_store()
        self.service = None
        self._stopped.set()

    async def wait(self) -> None:
        await self._stopped.wait()
