"""What the Chain Cache reports about a session (``ChainCache.info``): typed, frozen copies.

Nothing in a ``SessionInfo`` is shared with the live chain, so a reader on another thread (the
sidecar's event loop) never sees it change.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable

from engine.chain.records import PruneRecord
from engine.method_spec import MethodSpec
from engine.recall import RecallTraffic


@dataclass(frozen=True)
class SpanInfo:
    """A tagged span of a session's history: positions [start, end) written by ``role`` in ``turn``."""

    start: int
    end: int
    role: str
    turn: int
    pruned: bool


@dataclass(frozen=True)
class SessionInfo:
    """A session as the engine holds it."""

    session_id: Hashable
    state: str
    """active (a turn runs), idle (KV on the device), host (KV swapped to host memory), history (no KV)."""
    turn_index: int
    generation: int
    """Bumped by every change (turn, prune): what a snapshot is committed at."""
    num_tokens: int
    """History length."""
    cached_tokens: int
    """History tokens fed through the model (the last reply token is not yet)."""
    digest: str
    spec: MethodSpec
    """The session's sparse method (a copy)."""
    kv_tokens: int
    """KV entries on the GPU, summed over layers and kv-heads (0 when its KV is elsewhere)."""
    kv_pages: int
    cold_tokens: int
    """Evicted KV the recall tier keeps for it (``<method>+recall``)."""
    recall: RecallTraffic
    """What the recall tier copied during its last finished turn (a copy; zeros without ``+recall``)."""
    pruned_tokens: int
    prune_log: tuple[PruneRecord, ...]
    shared_prefix_tokens: int
    spans: tuple[SpanInfo, ...]
    last_token: int | None

    @property
    def method(self) -> str:
        return self.spec.method

    @property
    def is_empty(self) -> bool:
        """A new session whose first turn never ran: nothing worth keeping."""
        return self.turn_index == 0 and self.num_tokens == 0
