"""The janitor: a replica's periodic pass over the sessions it holds.

Each pass ends the sessions unused for ``session_ttl_s`` (``expire_idle``), frees the KV of sessions
idle for ``session_idle_s`` whose snapshot the store holds (``evict_idle``: they resume from it), and
sweeps the store (``SessionManager.sweep_store``). It works through the session manager only (the
store's one owner).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable, Protocol

from sidecar.sessions.manager import SessionManager
from sidecar.store.errors import StoreError, StoreUnavailable

log = logging.getLogger(__name__)


class JanitorSettings(Protocol):
    """What the janitor reads of the server's settings (``ServerOptions`` has both), each pass anew.
    A protocol rather than ``ServerOptions`` itself: the sessions sit below the server that owns its
    settings (docs/architecture.md, the sidecar's rooms)."""

    session_idle_s: float
    session_ttl_s: float


async def evict_idle(sessions: SessionManager, idle_s: float) -> int:
    """Free sessions idle for ``idle_s`` whose snapshot is committed (they resume from the store)."""
    if not sessions.has_store:
        return 0
    now = time.monotonic()
    victims = [
        s
        for s in sessions.all()
        if s.in_engine and not s.busy and not s.snapshot_pending and now - s.last_used > idle_s
    ]
    freed = 0
    for s in victims:
        try:  # free it only if the store still holds what this replica committed
            stored = await sessions.stored(s.key)
        except StoreError as e:
            log.warning("session %s kept here: its stored copy cannot be checked (%s)", s.key, e)
            continue
        if s.busy or s.stale or sessions.local(s.key) is not s or sessions.store_behind(s, stored):
            continue
        await sessions.drop_local(s)
        freed += 1
    return freed


async def expire_idle(sessions: SessionManager, ttl_s: float) -> int:
    """End, on this replica, the sessions unused for ``ttl_s`` (their KV is freed; their stored
    snapshot, if any, expires by the store's own TTL, as another replica may have continued the
    session there). A session with a turn running, or a snapshot the store has yet to get, is kept."""
    now = time.monotonic()
    victims = [
        s
        for s in sessions.all()
        if not s.busy and now - s.last_used > ttl_s and not (sessions.has_store and s.snapshot_pending)
    ]
    for s in victims:
        s.ended = True
        await sessions.drop_local(s)
        if not sessions.has_store:  # nothing of it is left anywhere
            sessions.ended.add(s.key)
    return len(victims)


async def janitor_loop(
    sessions: SessionManager, options: JanitorSettings, store_failed: Callable[[BaseException, str], None]
) -> None:
    """Run a pass every quarter of the shorter of ``session_idle_s`` and ``session_ttl_s`` (1-60 s).
    ``store_failed``: told when a pass found the store down (logged once a minute)."""
    while True:
        o = options
        await asyncio.sleep(min(60.0, max(1.0, min(o.session_idle_s, o.session_ttl_s) / 4)))
        try:
            n = await expire_idle(sessions, o.session_ttl_s)
            if n:
                log.info("ended %d session(s) unused for %.0f s (session_ttl_s)", n, o.session_ttl_s)
            n = await evict_idle(sessions, o.session_idle_s)
            if n:
                log.info("freed %d idle session(s) (their snapshots are committed)", n)
            await asyncio.to_thread(sessions.sweep_store)
        except asyncio.CancelledError:
            raise
        except StoreUnavailable as e:
            store_failed(e, "the janitor's pass")
        except Exception:
            log.exception("janitor pass failed")
