"""Loading a session from the store: the committed record found (waiting for the turn a client
expects), then its KV joined and loaded into the engine.

A client that passes ``expected_turn_index`` ahead of this replica's copy makes the manager look in
the store (another replica may have moved the session on); a store that is behind the expectation
is polled for ``resume_wait_s`` (the write-behind snapshot may still be on its way), and
``StoreBehind`` says it still was. ``behind_expected`` turns that into what the caller is told: a
Turn is refused with ``TurnIndexMismatch`` carrying the turns the session really holds, Resume gets
UNAVAILABLE (StoreBehind) or NOT_FOUND where no copy exists. ``load_committed`` loads the committed
KV when this replica's model made it, else the history alone (the session is recomputed).

``SessionManager`` (manager.py) calls these under its per-key load lock; they keep no state.
"""

from __future__ import annotations

import asyncio
import logging
import time

from engine.api import MethodError, SessionError, SessionNotFound, TurnIndexMismatch
from sidecar.engine_bridge.client import EngineClient
from sidecar.session_ids import SessionKey
from sidecar.sessions.record import Session, recorded_in
from sidecar.sessions.snapshot_codec import join_snapshot
from sidecar.store.base import SessionStore
from sidecar.store.errors import StoreUnavailable
from sidecar.store.record import StoredSession

log = logging.getLogger(__name__)


class StoreBehind(StoreUnavailable):
    """The store does not hold the turn the client expects yet (its snapshot may be in flight).
    ``have``: the turn index it holds (None: no record)."""

    def __init__(self, message: str, have: int | None = None):
        super().__init__(message)
        self.have = have


def behind_expected(
    key: str, local: Session | None, e: StoreBehind, expected: int | None, create: bool
) -> SessionError | StoreUnavailable:
    """Neither this replica nor the store holds turn ``expected`` after the wait: the error to raise.
    A Turn (``create``) learns where the session really is: the newer of this replica's copy and the
    store's (0 where neither has one)."""
    sid = SessionKey.id_of(key)
    here = local is not None and local.in_engine and not local.stale
    if create:
        have = max(local.turn_index if here else 0, e.have or 0)
        return TurnIndexMismatch(
            f"session {sid!r} is at turn {have}, not {expected}: turns were lost (a crash before their "
            f"snapshot, a store restored from older data); send the messages after its first {have} turns again",
            have,
            expected,
        )
    if e.have is None and (local is None or not local.in_engine):
        return SessionNotFound(f"no session {sid!r} at turn {expected} in the store")
    return e


async def fetch_committed(
    store: SessionStore,
    key: str,
    expected: int | None,
    deadline: float | None,
    *,
    resume_wait_s: float,
    request_id: str = "",
) -> StoredSession | None:
    """The committed record (no KV yet), waiting for ``expected`` while the store is behind."""
    wait_until = time.monotonic() + resume_wait_s
    if deadline is not None:
        wait_until = min(wait_until, deadline)
    delay = 0.05
    while True:
        stored = await asyncio.to_thread(store.load, key, False)
        if expected is None or expected == 0 and stored is None:
            return stored
        have = stored.turn_index if stored is not None else None
        if have is not None and have > expected and request_id and recorded_in(stored.app, request_id):
            return stored  # a retry of a turn the store recorded: its reply is replayed
        if have is not None and have > expected:
            raise TurnIndexMismatch(
                f"session {SessionKey.id_of(key)!r} is at turn {have}, not {expected}", have, expected
            )
        if have == expected:
            return stored
        if time.monotonic() >= wait_until:
            raise StoreBehind(
                f"the store holds turn {have} of session {SessionKey.id_of(key)!r}, not turn {expected} yet; retry",
                have,
            )
        await asyncio.sleep(delay)
        delay = min(0.5, delay * 2)


async def load_committed(engine: EngineClient, store: SessionStore, key: str, end_of_turn_id: int | None) -> Session:
    """Load a committed session into the engine (its KV if usable, else its history)."""
    stored = await asyncio.to_thread(store.load, key, True)
    if stored is None:
        raise SessionNotFound(f"no session {SessionKey.id_of(key)!r}")
    snap, kv_error = await asyncio.to_thread(join_snapshot, stored)
    fingerprint = engine.model.fingerprint
    if snap.kv is not None and snap.meta.get("fingerprint") != fingerprint:
        kv_error = f"the stored KV was made by {snap.meta.get('fingerprint')!r}, this replica is {fingerprint!r}"
        snap.kv = None
    snap.meta["session_id"] = key
    try:
        info = await engine.load(snap)
    except MethodError as e:  # KV this replica cannot continue: refuse rather than guess
        raise SessionError(f"session {SessionKey.id_of(key)!r} uses a method this replica cannot run: {e}") from None
    s = Session(
        key=key,
        in_engine=True,
        committed_generation=stored.generation,
        source_tier="store" if snap.kv is not None else "recompute",
        snapshot_error=kv_error,
    )
    s.load_app_meta(stored.app)
    s.update(info, end_of_turn_id)
    if s.eviction_priority:
        await engine.set_eviction_priority(key, s.eviction_priority)
    if kv_error:
        log.warning("session %s: %s; it will be rebuilt from its history", key, kv_error)
    return s
