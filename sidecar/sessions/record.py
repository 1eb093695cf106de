"""The sidecar's record of one session (``Session``) and of the turn running on it (``Running``).

A ``Session`` is what the sidecar keeps beside the engine's chain: its generation and turn index
as last seen, what the store holds of it, the tools of its first turn, the front end's state
(``front``), and the finished turns' completions by ``request_id`` (the idempotency records). All
but the engine's own record travel with the session's snapshot as its ``app`` metadata
(``app_meta`` / ``load_app_meta``), so a retry that lands on another replica after a failover is
recognised too (``recorded_in``). ``sidecar.sessions.manager.SessionManager`` makes, finds and drops them.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from engine.api import SessionInfo


@dataclass
class Running:
    """The turn running on a session."""

    request_id: str
    done: asyncio.Future
    """Resolves to the recorded completion bytes, or None when the turn did not finish."""
    settling: bool = False
    """The turn will not finish (its caller is gone, or it failed) and is being rolled back: a
    request that waited for the session (``get_settled``) takes it once it is released, instead of
    being refused."""
    digest: str = ""
    """The request's content digest (sidecar.turns.validation.request_digest)."""


@dataclass
class Session:
    key: str
    in_engine: bool = False
    """The engine holds its chain (False only before a new session's first turn starts)."""
    generation: int = 0
    turn_index: int = 0
    committed_generation: int | None = None
    """The generation the store holds for it (loaded or last written); None: none written."""
    snapshot_error: str | None = None
    stale: bool = False
    """Another replica committed a newer generation: the next request reloads it from the store."""
    source_tier: str | None = None
    """Where this replica got the session: new, store or recompute."""
    tools_digest: str = ""
    tools: list = field(default_factory=list)
    """The tools of its first turn (``ToolSpec.openai`` dicts): what a forced tool call may call."""
    front: dict = field(default_factory=dict)
    """State a front end keeps with the session (the HTTP front: its transcript digest and response
    records); msgpack-able, it travels with the snapshot."""
    front_changes: int = 0
    """Changes made to ``front`` between turns (a deleted response): each makes a snapshot pending
    although the engine's generation did not move (``front_changed``)."""
    committed_front_changes: int = 0
    """``front_changes`` as of the last snapshot written."""
    pinned_until: float = 0.0
    """``time.monotonic()`` until which an agent hint pins the session on the engine (the tenant's
    pin quota counts these)."""
    ends_with_eot: bool = False
    """The history ends with the end-of-turn token (the last reply closed its turn)."""
    eviction_priority: int = 0
    """Set by ``/v1/prefix_cache/set_eviction_priority``: idle sessions of a lower priority leave the
    GPU first (the engine's ``Chain.eviction_priority``; re-applied when the session is loaded)."""
    records: "OrderedDict[str, bytes]" = field(default_factory=OrderedDict)
    request_digests: dict[str, str] = field(default_factory=dict)
    """request_id -> the digest of the request it named (a reuse for other content is refused)."""
    running: Running | None = None
    created_at: float = field(default_factory=time.time)
    last_used: float = field(default_factory=time.monotonic)
    store_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    """Held while the session's snapshot is written or deleted (an ended session stays deleted)."""
    ended: bool = False

    @property
    def busy(self) -> bool:
        return self.running is not None

    @property
    def snapshot_pending(self) -> bool:
        return (
            self.in_engine
            and not self.stale
            and (
                self.committed_generation is None
                or self.committed_generation < self.generation
                or self.committed_front_changes < self.front_changes
            )
        )

    def front_changed(self) -> None:
        """``front`` changed outside a turn: the store must get it too (at the same generation)."""
        self.front_changes += 1

    def app_meta(self) -> dict[str, Any]:
        """What the sidecar keeps about the session beside the engine's record."""
        return {
            "tools_digest": self.tools_digest,
            "tools": self.tools,
            "front": self.front,
            "eviction_priority": self.eviction_priority,
            "created_at": self.created_at,
            "requests": [[rid, blob] for rid, blob in self.records.items()],
            "request_digests": {rid: self.request_digests[rid] for rid in self.records if rid in self.request_digests},
        }

    def load_app_meta(self, app: dict[str, Any]) -> None:
        self.tools_digest = app.get("tools_digest", "")
        self.tools = list(app.get("tools") or [])
        self.front = dict(app.get("front") or {})
        priority = app.get("eviction_priority", 0)
        self.eviction_priority = priority if isinstance(priority, int) and not isinstance(priority, bool) else 0
        self.created_at = app.get("created_at", self.created_at)
        self.records = OrderedDict((rid, bytes(blob)) for rid, blob in app.get("requests", []))
        digests = app.get("request_digests") or {}
        self.request_digests = {str(k): str(v) for k, v in digests.items()} if isinstance(digests, dict) else {}

    def update(self, info: SessionInfo, end_of_turn_id: int | None) -> None:
        """Refresh from the engine's view of the session."""
        self.generation = info.generation
        self.turn_index = info.turn_index
        self.ends_with_eot = end_of_turn_id is not None and info.last_token == end_of_turn_id
        self.last_used = time.monotonic()


def recorded_in(app: dict[str, Any], request_id: str) -> bool:
    """Does a stored session's sidecar metadata record a finished turn under ``request_id``?"""
    return any(rid == request_id for rid, *_ in app.get("requests", []))


__all__ = ["Running", "Session", "recorded_in"]
