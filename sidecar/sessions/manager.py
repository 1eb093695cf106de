"""SessionManager: session id -> the engine's chain, per-session ordering, idempotency, the store.

Session keys (tenant-scoped ids) are ``sidecar.session_ids.SessionKey``; the per-session record the
manager keeps (``Session``, ``Running``) is ``sidecar.sessions.record``.

The store's one owner. Every read of the session store (loading, ``stored``, the transcript index
built on it) and every write (through its ``SnapshotWriter``, passed in: ``mark_dirty``,
``write_now``, ``commit_turn``, ``end``) goes through the manager; the fronts never hold the store.

Ordering. One turn runs on a session at a time: ``begin_turn`` takes the session and ``end_turn``
releases it. A second Turn, a prune or a fork meanwhile waits for the running turn to end
(``get_settled``): it runs if that turn was rolled back (its caller went away), and gets ABORTED
if that turn finished. Loading a session from the
store is serialized per key, so two requests racing for an unknown session load it once.

Idempotency. Each finished turn is recorded by its ``request_id`` (the serialized
TurnCompletion), the last ``idempotency_window`` per session; the records travel with the
session's snapshot, so a retry that lands on another replica after a failover is recognised too.
A retry that arrives while its first attempt still runs waits for it.

Where a session comes from (``get``): this replica, when it holds the session and nothing says
its copy is stale; otherwise the store (loading.py: the committed record, waited for while the
store is behind the turn a client expects, then loaded into the engine). A Turn whose expected
turns neither holds is refused with ``TurnIndexMismatch`` carrying the turns the session really
holds (the turns the client expects were lost: a crash under write-behind, a store rolled back),
so the client re-sends the messages the session lacks; it never runs against the older state.
"""

from __future__ import annotations

import asyncio
import logging
import time
import weakref

from engine.api import SessionBusy, SessionError, SessionInfo, SessionNotFound
from sidecar.engine_bridge.client import EngineClient
from sidecar.session_ids import SessionKey
from sidecar.sessions.ended import EndedSessions
from sidecar.sessions.loading import StoreBehind, behind_expected, fetch_committed, load_committed
from sidecar.sessions.record import Running, Session
from sidecar.sessions.snapshots import SnapshotWriter
from sidecar.store import transcript_index
from sidecar.store.base import SessionStore
from sidecar.store.errors import StoreUnavailable
from sidecar.store.record import StoredSession
from sidecar.store.transcript_index import StoredTranscripts

log = logging.getLogger(__name__)


class SessionManager:
    def __init__(
        self,
        engine: EngineClient,
        store: SessionStore | None,
        *,
        writer: SnapshotWriter | None = None,
        end_of_turn_id: int | None,
        idempotency_window: int = 32,
        resume_wait_s: float = 5.0,
        settle_wait_s: float = 10.0,
    ):
        self.engine = engine
        self.settle_wait_s = settle_wait_s
        """How long a request waits for the turn running on its session to end (``get_settled``)."""
        self.store = store
        self.writer = writer
        """Writes the sessions' snapshots behind their turns (None: no store, or none wanted)."""
        if writer is not None:
            writer.attach(self)
        self.end_of_turn_id = end_of_turn_id
        self.idempotency_window = idempotency_window
        self.resume_wait_s = resume_wait_s
        self._sessions: dict[str, Session] = {}
        self._load_locks: "weakref.WeakValueDictionary[str, asyncio.Lock]" = weakref.WeakValueDictionary()
        self.loads = {"store": 0, "recompute": 0}
        self.ended = EndedSessions()
        """Keys of the sessions ended or expired here (a chain client is told they are gone)."""

    # --- lookup -----------------------------------------------------------------------------------
    def local(self, key: str) -> Session | None:
        return self._sessions.get(key)

    def all(self) -> list[Session]:
        return list(self._sessions.values())

    @property
    def active_turns(self) -> int:
        return sum(1 for s in self._sessions.values() if s.busy)

    async def get(
        self,
        key: str,
        *,
        create: bool,
        expected_turn_index: int | None = None,
        deadline: float | None = None,
        request_id: str = "",
    ) -> Session:
        """The session, from this replica or the store; a fresh (not yet started) one when it
        exists nowhere and ``create``. Raises SessionNotFound, StoreUnavailable (StoreBehind),
        TurnIndexMismatch. ``request_id``: a retry whose turn the store already recorded is served
        from the store even though its ``expected_turn_index`` is behind (the reply is replayed)."""
        s = self._sessions.get(key)
        if s is not None and self._usable(s, expected_turn_index):
            return s
        lock = self._load_locks.get(key)
        if lock is None:
            lock = self._load_locks[key] = asyncio.Lock()
        async with lock:
            s = self._sessions.get(key)
            if s is not None and self._usable(s, expected_turn_index):
                return s
            if self.store is None:
                return self._new_or_missing(key, create)
            try:
                stored = await fetch_committed(
                    self.store,
                    key,
                    expected_turn_index,
                    deadline,
                    resume_wait_s=self.resume_wait_s,
                    request_id=request_id,
                )
            except StoreBehind as e:
                raise behind_expected(key, s, e, expected_turn_index, create) from None
            if s is not None and s.in_engine and not s.stale and self.store_behind(s, stored):
                return s  # this replica holds more than the store: keep it (the store is rewritten)
            if stored is None:
                if s is not None:
                    await self.drop_local(s)
                return self._new_or_missing(key, create)
            if s is not None:
                if not s.stale and s.committed_generation is not None and stored.generation <= s.committed_generation:
                    return s  # the store holds nothing newer than this replica
                if s.busy:
                    raise SessionBusy(f"a turn is already running on session {SessionKey.id_of(key)!r}")
                await self.drop_local(s)
            return await self._load(key)

    async def get_settled(
        self,
        key: str,
        *,
        create: bool,
        expected_turn_index: int | None = None,
        deadline: float | None = None,
        request_id: str = "",
    ) -> Session:
        """``get``, once the turn running on the session (if any) has ended. A request for a busy
        session waits for that turn (at most ``settle_wait_s``, or to ``deadline``): the client may
        have cancelled it, and gRPC may hand the server the next request before that cancel (the two
        travel separately), so the running turn alone tells whether the session is free. If it was
        rolled back (its caller went away, or it failed) the session is looked up again and this
        request takes it; if it finished, this request came while it ran and is refused
        (SessionBusy, ABORTED). A retry of the running turn's own ``request_id`` is returned at once
        (``TurnRunner`` waits for and replays that turn). A session still held after the wait is
        returned busy, and taking it raises SessionBusy."""
        until = time.monotonic() + self.settle_wait_s
        if deadline is not None:
            until = min(until, deadline)
        while True:
            s = await self.get(
                key, create=create, expected_turn_index=expected_turn_index, deadline=deadline, request_id=request_id
            )
            running = s.running
            left = until - time.monotonic()
            if running is None or left <= 0 or (request_id and running.request_id == request_id):
                return s
            try:
                await asyncio.wait_for(asyncio.shield(running.done), left)
            except asyncio.TimeoutError:
                return s
            if not running.settling:  # it finished (or a fork or prune did): this request came while it ran
                raise SessionBusy(f"a turn is already running on session {SessionKey.id_of(key)!r}")
            # rolled back, the session released (or dropped: a first turn that never ran): look it up again

    def store_behind(self, s: Session, stored) -> bool:
        """The store holds less than this replica committed for ``s`` (it lost or rolled back data):
        note it, so the writer rewrites the store from this copy. True also when nothing was committed
        yet (the first snapshot is on its way)."""
        have = stored.generation if stored is not None else None
        if s.committed_generation is None:
            return stored is None
        if have is not None and have >= s.committed_generation:
            return False
        log.warning(
            "session %s: the store holds generation %s, this replica committed %s; rewriting it",
            s.key,
            have,
            s.committed_generation,
        )
        s.committed_generation = have
        self.mark_dirty(s.key)  # the writer rewrites the store from this copy
        return True

    def _usable(self, s: Session, expected: int | None) -> bool:
        if s.busy:
            return True  # the caller gets ABORTED (or waits for its retried request)
        if s.stale or not s.in_engine:
            return not s.stale and not s.in_engine and expected in (None, 0)
        return expected is None or expected <= s.turn_index

    def _new_or_missing(self, key: str, create: bool) -> Session:
        s = self._sessions.get(key)
        if s is not None and not s.stale:
            return s
        if not create:
            raise SessionNotFound(f"no session {SessionKey.id_of(key)!r}")
        s = Session(key=key)
        self._sessions[key] = s
        return s

    async def _load(self, key: str) -> Session:
        """Load a committed session into the engine (loading.py) and hold it here."""
        s = await load_committed(self.engine, self.store, key, self.end_of_turn_id)
        self._sessions[key] = s
        self.loads[s.source_tier] += 1  # "store" (its KV) or "recompute" (its history)
        return s

    async def drop_local(self, s: Session) -> None:
        """Forget ``s`` here and free its KV (its snapshot, if any, stays in the store)."""
        self._sessions.pop(s.key, None)
        if s.in_engine:
            await self.engine.end_session(s.key)

    def adopt(self, key: str, *, tools_digest: str, info: SessionInfo, tools: list | None = None) -> Session:
        """Register a session the engine just made (a fork)."""
        s = Session(key=key, in_engine=True, tools_digest=tools_digest, tools=list(tools or []), source_tier="new")
        s.update(info, self.end_of_turn_id)
        self._sessions[key] = s
        return s

    # --- turns ----------------------------------------------------------------------------------------
    def begin_turn(self, s: Session, request_id: str, digest: str = "") -> Running:
        if s.busy:
            raise SessionBusy(f"a turn is already running on session {SessionKey.id_of(s.key)!r}")
        if s.ended:
            raise SessionNotFound(f"session {SessionKey.id_of(s.key)!r} was ended")
        s.running = Running(request_id, asyncio.get_running_loop().create_future(), digest=digest)
        return s.running

    def record(self, s: Session, running: Running, completion: bytes) -> None:
        """Remember a finished turn's completion under its request_id (the last ``idempotency_window``)."""
        if not running.request_id:
            return
        s.records[running.request_id] = completion
        if running.digest:
            s.request_digests[running.request_id] = running.digest
        while len(s.records) > self.idempotency_window:
            rid, _ = s.records.popitem(last=False)
            s.request_digests.pop(rid, None)

    def end_turn(self, s: Session, running: Running, completion: bytes | None) -> None:
        if completion is not None:
            self.record(s, running, completion)
        if not running.done.done():
            running.done.set_result(completion)
        if s.running is running:
            s.running = None
        s.last_used = time.monotonic()
        if not s.in_engine and not s.busy and self._sessions.get(s.key) is s:
            del self._sessions[s.key]  # a new session whose first turn never started

    # --- ending ------------------------------------------------------------------------------------
    async def end(self, key: str, keep_snapshot: bool) -> tuple[bool, bool]:
        """End a session here (and delete its snapshot unless ``keep_snapshot``, else write it now).
        Returns (ended here, deleted from the store)."""
        s = self._sessions.get(key)
        here = s is not None and s.in_engine
        if s is not None:
            if keep_snapshot and here and self.store is not None and s.snapshot_pending:
                await self.write_now(key)
                if s.snapshot_pending:
                    raise StoreUnavailable(
                        f"the snapshot of {SessionKey.id_of(key)!r} could not be written: {s.snapshot_error}"
                    )
            s.ended = True
            if s.running is not None:
                self.engine.abort_soon(key)
            self._sessions.pop(key, None)
            if here:
                await self.engine.end_session(key)
        deleted = False
        if self.store is not None and not keep_snapshot:
            lock = s.store_lock if s is not None else asyncio.Lock()
            async with lock:
                deleted = await asyncio.to_thread(self.store.delete, key)
        if not here and not deleted and not keep_snapshot:
            raise SessionNotFound(f"no session {SessionKey.id_of(key)!r}")
        if not keep_snapshot:
            self.ended.add(key)
        return here, deleted

    # --- the store: snapshots written, records read ------------------------------------------------
    @property
    def has_store(self) -> bool:
        return self.store is not None

    def start(self) -> None:
        if self.writer is not None:
            self.writer.start()

    async def stop_writing(self, flush_timeout_s: float) -> None:
        """Write the pending snapshots (at most ``flush_timeout_s``) and stop the writer."""
        if self.writer is not None:
            if not await self.writer.flush(flush_timeout_s):
                log.warning("shutdown: %d session snapshot(s) not written", sum(s.snapshot_pending for s in self.all()))
            await self.writer.stop()

    def close_store(self) -> None:
        if self.store is not None:
            self.store.close()

    def mark_dirty(self, key: str) -> None:
        """The session changed: queue its snapshot."""
        if self.writer is not None:
            self.writer.mark_dirty(key)

    async def write_now(self, key: str) -> None:
        """Write the session's snapshot now, if the store is behind it."""
        if self.writer is not None:
            await self.writer.write(key)

    async def commit_turn(self, s: Session, running: Running, completion: bytes) -> None:
        """durability sync: record the turn and write its snapshot before its completion is sent."""
        if self.writer is None:
            return
        self.record(s, running, completion)
        await self.writer.write(s.key)
        if s.snapshot_pending:
            raise StoreUnavailable(
                f"the turn finished but its snapshot was not written ({s.snapshot_error}); "
                f"retry with the same request_id"
            )

    async def stored(self, key: str) -> StoredSession | None:
        """The store's committed record of the session (no KV); None without a store or a record."""
        if self.store is None:
            return None
        return await asyncio.to_thread(self.store.load, key, False)

    def transcripts(self, front_key: str, turn_key: str) -> StoredTranscripts | None:
        """The store's transcript index (sidecar/store/transcript_index.py), fed by each committed snapshot;
        None without a store and its writer, or for a store kind without an index."""
        if self.store is None or self.writer is None:
            return None
        try:
            index = StoredTranscripts(self.store, front_key, turn_key)
        except TypeError:
            return None
        self.writer.on_commit.append(index.put_committed)
        return index

    def sweep_store(self) -> None:
        """The janitor's pass over the store (expired sessions and transcript entries; run in a thread)."""
        sweep = getattr(self.store, "sweep", None)
        if sweep is not None:
            sweep()
        transcript_index.sweep(self.store)


__all__ = ["SessionError", "SessionManager"]
