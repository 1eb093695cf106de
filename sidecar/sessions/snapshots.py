"""SnapshotWriter: sessions written to the store behind their turns.

A turn marks its session dirty and returns; one writer task takes the session's current snapshot on the engine thread (so a burst of turns
is written once, and at most one snapshot is held in memory), serializes it off the event loop
and commits it on the generation it last committed. The queue of dirty sessions is bounded and
marking never blocks a turn: past the bound, the writer finds the overflow later by scanning for
sessions whose committed generation is behind. A store that cannot be reached is retried with
exponential backoff until it comes back.

A commit that finds another generation in the store than the one this replica last committed
tells two cases apart:

* **another replica is newer**: the store holds a generation above the one committed here (or
  its freshness fence does): the local copy is marked stale and the next request reloads it;
* **the store is older or empty**: Redis restarted without persistence, a replica was promoted
  from a lagging copy, a backup was restored: the store holds less than this replica committed.
  The holder keeps its session (its turn index never goes backwards) and rewrites the store on
  the generation it now finds there.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Callable, Protocol

from engine.api import SessionBusy, SessionNotFound
from sidecar.engine_bridge.client import EngineClient
from sidecar.sessions.record import Session
from sidecar.sessions.snapshot_codec import join_snapshot, split_snapshot
from sidecar.store.base import SessionStore
from sidecar.store.errors import GenerationConflict, StoreError, StoreUnavailable
from sidecar.store.health import StoreHealth
from sidecar.store.record import StoredSession

__all__ = ["SnapshotWriter", "join_snapshot", "split_snapshot"]  # the codec's home: sidecar.sessions.snapshot_codec

log = logging.getLogger(__name__)


class SessionTable(Protocol):
    """The sessions this replica holds (the session manager, which owns the writer)."""

    def local(self, key: str) -> Session | None: ...

    def all(self) -> list[Session]: ...


class SnapshotWriter:
    """Owned by the session manager (``SessionManager(writer=...)``), which gives it its table of
    sessions (``attach``) and marks sessions dirty through it."""

    def __init__(
        self,
        store: SessionStore,
        engine: EngineClient,
        *,
        with_kv: bool = True,
        max_pending: int = 4096,
        retry_base_s: float = 0.2,
        retry_max_s: float = 5.0,
        hooks: Any = None,
        store_health: StoreHealth | None = None,
    ):
        self.store = store
        self.client = engine
        self.sessions: SessionTable | None = None
        """Set by ``attach``."""
        self.with_kv = with_kv
        self.retry_base_s, self.retry_max_s = retry_base_s, retry_max_s
        self.hooks = hooks
        self.store_health = store_health
        """Where a write that found the store down is logged (at most once a minute); None: each one."""
        self._queue: asyncio.Queue[str] = asyncio.Queue(maxsize=max_pending)
        self._queued: set[str] = set()
        self._busy = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._task: asyncio.Task | None = None
        self._overflow = False
        self.failures = 0
        self.writes = 0
        self.rewrites = 0
        """Sessions written again because the store had lost or rolled back their last commit."""
        self.on_commit: list[Callable[[str, StoredSession], None]] = []
        """Called (in a worker thread) after each commit with the session's key and what was committed
        (``app`` is the sidecar metadata stored with it): the HTTP front indexes the session's transcript there. A StoreError is logged."""

    def attach(self, sessions: SessionTable) -> None:
        """Write the sessions of ``sessions`` (its owner's table)."""
        self.sessions = sessions

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="chainkv-snapshot-writer")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None

    @property
    def pending(self) -> int:
        return self._queue.qsize() + self._busy

    def mark_dirty(self, key: str) -> None:
        """Queue ``key`` for writing (once, however often it is marked before the writer gets to it)."""
        self._idle.clear()
        if key in self._queued:
            return
        if self._queue.full():
            self._overflow = True
            return
        self._queued.add(key)
        self._queue.put_nowait(key)

    async def flush(self, timeout: float | None = None) -> bool:
        """Wait until every dirty session is written (or ``timeout``); True if all were."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
            return True
        except asyncio.TimeoutError:
            return False

    async def _run(self) -> None:
        failures = 0
        while True:
            if self._queue.empty() and self._overflow:
                self._overflow = False
                for s in self.sessions.all():
                    if s.snapshot_pending:
                        self.mark_dirty(s.key)
            if self._queue.empty() and self._busy == 0 and not self._overflow:
                self._idle.set()
            key = await self._queue.get()
            self._queued.discard(key)
            self._busy += 1
            try:
                if failures:  # the store was down: check it before taking another snapshot
                    await asyncio.to_thread(self.store.ping)
                await self.write(key)
                failures = 0
            except StoreUnavailable as e:
                failures += 1
                self.failures += 1
                session = self.sessions.local(key)
                if session is not None:
                    session.snapshot_error = str(e)
                self._failed(key, "unavailable")
                delay = min(self.retry_max_s, self.retry_base_s * 2 ** min(failures - 1, 20))
                if self.store_health is not None:
                    self.store_health.failed(e, f"the snapshot of {key}")
                else:
                    log.warning("snapshot of %s not written (%s); retrying in %.1fs", key, e, delay)
                await asyncio.sleep(delay)
                if self.sessions.local(key) is not None:
                    self.mark_dirty(key)
            except Exception:  # a bug must not stop the writer
                log.exception("snapshot of %s failed", key)
                self._failed(key, "error")
            finally:
                self._busy -= 1

    def _failed(self, key: str, reason: str) -> None:
        hook = getattr(self.hooks, "on_snapshot_failed", None)
        if hook is not None:
            hook(key, reason)

    async def write(self, key: str) -> None:
        """Write ``key``'s current state if the store is behind it."""
        session = self.sessions.local(key)
        if session is None:
            return
        async with session.store_lock:
            if session.ended or not session.snapshot_pending:
                return
            started = time.monotonic()
            try:
                snap = await self.client.snapshot(key, self.with_kv)
            except (SessionBusy, SessionNotFound):
                return  # a turn started since (its end marks the session dirty again), or it ended
            generation = int(snap.meta["generation"])
            front_changes = session.front_changes  # what app_meta below carries
            stored = await asyncio.to_thread(split_snapshot, snap, session.app_meta())
            expected = session.committed_generation
            for attempt in range(2):
                try:
                    await asyncio.to_thread(self.store.save, key, stored, expected)
                    break
                except GenerationConflict as e:
                    if attempt == 0 and store_regressed(session.committed_generation, e):
                        log.warning(
                            "%s: the store lost or rolled back this session (it holds generation %s, this "
                            "replica committed %s); rewriting it",
                            key,
                            e.found,
                            session.committed_generation,
                        )
                        expected = e.found
                        self.rewrites += 1
                        continue
                    session.stale = True
                    session.snapshot_error = str(e)
                    log.warning("%s; this replica's copy is stale", e)
                    self._failed(key, "conflict")
                    return
                except StoreUnavailable:
                    raise
                except StoreError as e:
                    session.snapshot_error = str(e)
                    log.error("snapshot of %s refused: %s", key, e)
                    self._failed(key, "refused")
                    return
            if self.store_health is not None:
                self.store_health.answered()
            session.committed_generation = generation
            session.committed_front_changes = front_changes
            session.snapshot_error = None
            self.writes += 1
            if self.hooks is not None:
                self.hooks.on_snapshot(key, len(stored.kv or b""), time.monotonic() - started)
            for listener in self.on_commit:
                try:
                    await asyncio.to_thread(listener, key, stored)
                except StoreError as e:
                    log.warning("after the snapshot of %s: %s", key, e)


def store_regressed(committed: int | None, conflict: GenerationConflict) -> bool:
    """Does ``conflict`` mean the store is older than (or lost) what this replica committed, rather
    than that another replica committed something newer?"""
    if conflict.fenced or committed is None:
        return False
    return conflict.found is None or conflict.found < committed
