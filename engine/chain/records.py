"""A session's engine-side record (``Chain``), its states and the tier a turn found it in."""

from __future__ import annotations

import enum
import hashlib
import time
from dataclasses import dataclass, field
from typing import Any, Hashable

import numpy as np

from engine.cache.snapshot import SessionSnapshot
from engine.lifecycle import Span
from engine.method_spec import MethodSpec
from engine.prefix import QueryWindow
from engine.sequence import Sequence


class Tier(str, enum.Enum):
    """Where a turn found its session."""

    NEW = "new"
    GPU = "gpu"
    HOST = "host"
    STORE = "store"
    RECOMPUTE = "recompute"


class ChainState(str, enum.Enum):
    ACTIVE = "active"
    IDLE = "idle"  # KV on the GPU
    HOST = "host"  # KV in host RAM
    HISTORY = "history"  # only the token history: the next turn re-prefills it


@dataclass
class TaggedSpan(Span):
    turn: int = 0
    pruned: bool = False


@dataclass(frozen=True)
class PruneRecord:
    """One pruning of a session's history KV (a prune call, or the automatic lag / trigger rule)."""

    turn: int
    start: int
    end: int
    policy: str
    keep_ratio: float
    scope: str
    reason: str
    removed: int
    """KV entries removed, summed over layers and kv-heads."""

    @classmethod
    def from_record(cls, e: dict[str, Any]) -> "PruneRecord":
        """A record as a snapshot's prune log stores it (a store record's missing fields read as empty)."""
        return cls(
            turn=int(e.get("turn", 0)),
            start=int(e["start"]),
            end=int(e["end"]),
            policy=e.get("policy") or "",
            keep_ratio=float(e.get("keep_ratio") or 0.0),
            scope=e.get("scope") or "",
            reason=e.get("reason") or "",
            removed=int(e.get("removed", 0)),
        )

    @property
    def tokens(self) -> int:
        """History tokens the pruning covered."""
        return self.end - self.start


@dataclass
class Chain:
    session_id: Hashable
    seq: Sequence
    spec: MethodSpec
    turn_index: int = 0
    generation: int = 0
    state: ChainState = ChainState.IDLE
    spans: list[TaggedSpan] = field(default_factory=list)
    prune_log: list[PruneRecord] = field(default_factory=list)
    host: SessionSnapshot | None = None
    """The KV and method state in host RAM (state HOST), or a loaded store snapshot."""
    host_source: Tier = Tier.HOST
    last_used: float = field(default_factory=time.monotonic)
    eviction_priority: int = 0
    """Idle chains of a lower priority are demoted (GPU -> host -> history) first; least recently
    used first within one priority (``ChainTiers.demotion_order``)."""
    prefix_holder: tuple | None = None
    prefix_hashes: list[bytes] = field(default_factory=list)
    """Page hashes of a shared prefix this session prefills; a holder is registered under them
    once the prefill reaches ``seq.prefix_boundary``."""
    queries: QueryWindow | None = None
    pruned_tokens: int = 0
    pinned_until: float = 0.0
    """Agent hints (engine/chain/hints.py): while ``time.monotonic()`` is below this, an idle chain is
    not demoted from the GPU."""
    hints: Any = None
    """The running (or last) turn's SessionHints, applied when the turn ends."""
    expected_at: float | None = None
    """Agent hints: when (``ChainTiers.clock``) the agent expects its next turn (the last turn's
    ``expected_return_s`` after it ended); a chain in host memory is prefetched onto the GPU shortly
    before. None: not said, or already prefetched, or the turn has come."""
    prefetched: bool = False
    """Brought back onto the GPU ahead of its next turn (``ChainTiers.prefetch``); cleared when it comes."""
    priority: int = 0
    """Agent hints: idle chains of lower priority are demoted first; its turns are admitted first."""
    _hash: Any = field(default_factory=hashlib.sha256)
    _hashed: int = 0

    def pinned(self, now: float) -> bool:
        return self.pinned_until > now

    def reset_digest(self) -> None:
        self._hash, self._hashed = hashlib.sha256(), 0

    @property
    def history(self) -> list[int]:
        return self.seq.token_ids

    @property
    def digest(self) -> str:
        h = self._hash
        if self._hashed < len(self.history):
            h.update(np.asarray(self.history[self._hashed :], dtype="<u4").tobytes())
            self._hashed = len(self.history)
        return h.hexdigest()


def history_digest(tokens: list[int]) -> str:
    return hashlib.sha256(np.asarray(tokens, dtype="<u4").tobytes()).hexdigest()
