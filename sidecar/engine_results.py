"""What ``EngineClient`` hands back across the engine-thread boundary: typed, immutable values.

The engine describes a session with a dict (``LLMEngine.session_info``) and streams
``RequestOutput`` objects whose token list it keeps appending to. Neither should leak into the
asyncio side: a dict has no schema a reader can check, and a live list read on another thread
races the engine. The client converts both, on the engine thread, into the frozen dataclasses
here; the gRPC servicer, the session manager and an HTTP front all read these.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any

from engine.turn_timing import TurnTiming


@dataclass(frozen=True)
class SpanInfo:
    """A tagged span of a session's history: positions [start, end) written by ``role`` in ``turn``."""

    start: int
    end: int
    role: str
    turn: int
    pruned: bool


@dataclass(frozen=True)
class PruneRecord:
    """One pruning of the history's KV (a PruneHistory call, or the automatic lag/trigger rule)."""

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
    def from_engine(cls, e: dict[str, Any]) -> "PruneRecord":
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
        return self.end - self.start


@dataclass(frozen=True)
class RecallTrafficInfo:
    """What the recall tier copied during the session's last turn (engine/recall.py's RecallTraffic)."""

    d2h_bytes: int = 0
    h2d_bytes: int = 0
    pages_fetched: int = 0
    recalled_tokens: int = 0
    recalls: int = 0

    @classmethod
    def from_engine(cls, d: dict[str, Any] | None) -> "RecallTrafficInfo":
        d = d or {}
        return cls(**{f.name: int(d.get(f.name, 0)) for f in fields(cls)})

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


@dataclass(frozen=True)
class MethodInfo:
    """The sparse method a session runs with."""

    method: str
    budget: int | None = None
    budget_ratio: float | None = None
    method_args: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_engine(cls, spec: dict[str, Any] | None) -> "MethodInfo | None":
        if not isinstance(spec, dict):
            return None
        return cls(
            method=spec.get("method") or "",
            budget=spec.get("budget"),
            budget_ratio=spec.get("budget_ratio"),
            method_args=dict(spec.get("method_args") or {}),
        )


@dataclass(frozen=True)
class SessionInfo:
    """A session as the engine holds it (``LLMEngine.session_info``, typed)."""

    session_id: str
    state: str
    """active (a turn runs), idle (KV on the device), host (KV swapped to host memory), history (no KV)."""
    turn_index: int
    generation: int
    """Bumped by every change (turn, prune): what a snapshot is committed at."""
    num_tokens: int
    """History length."""
    digest: str
    method: str
    spec: MethodInfo | None
    kv_tokens: int
    kv_pages: int
    pruned_tokens: int
    prune_log: tuple[PruneRecord, ...]
    shared_prefix_tokens: int
    spans: tuple[SpanInfo, ...]
    last_token: int | None
    recall: RecallTrafficInfo = RecallTrafficInfo()
    """The recall tier's copies during the last turn (zeros without ``+recall``)."""

    @classmethod
    def from_engine(cls, d: dict[str, Any]) -> "SessionInfo":
        m = d.get("method")
        return cls(
            session_id=str(d["session_id"]),
            state=d["state"],
            turn_index=int(d["turn_index"]),
            generation=int(d["generation"]),
            num_tokens=int(d["num_tokens"]),
            digest=d.get("digest") or "",
            method=m if isinstance(m, str) else "",
            spec=MethodInfo.from_engine(d.get("spec")),
            kv_tokens=int(d.get("kv_tokens", 0)),
            kv_pages=int(d.get("kv_pages", 0)),
            pruned_tokens=int(d.get("pruned_tokens", 0)),
            prune_log=tuple(PruneRecord.from_engine(e) for e in d.get("prune_log", [])),
            shared_prefix_tokens=int(d.get("shared_prefix_tokens", 0)),
            spans=tuple(
                SpanInfo(int(s["start"]), int(s["end"]), s["role"], int(s["turn"]), bool(s["pruned"]))
                for s in d.get("spans", [])
            ),
            last_token=d.get("last_token"),
            recall=RecallTrafficInfo.from_engine(d.get("recall_traffic")),
        )

    @property
    def is_empty(self) -> bool:
        """A new session whose first turn never ran: nothing worth keeping."""
        return self.turn_index == 0 and self.num_tokens == 0


@dataclass(frozen=True)
class TurnDelta:
    """What one engine step added to a running turn."""

    text: str
    token_ids: tuple[int, ...]
    last: bool
    """The turn's final output (its ``TurnResult`` is set on the stream)."""


@dataclass(frozen=True)
class TurnResult:
    """How a turn ended, with the session as it stands after it."""

    finish_reason: str
    """stop, length, abort (stopped by EndSession or an abort) or error (the KV pool could not hold it)."""
    error: str | None
    token_ids: tuple[int, ...]
    prompt_tokens: int
    reused_tokens: int
    prefilled_tokens: int
    time_to_first_token: float | None
    source_tier: str | None
    """Where the turn found its session: new, gpu, host, store or recompute."""
    session: SessionInfo | None
    """None when the session is gone (an aborted first turn)."""
    new_prunes: tuple[PruneRecord, ...] = ()
    """Prunings the turn's end triggered (lag / trigger rule)."""
    timing: TurnTiming | None = None
    """Where the turn's time went on the engine (engine/turn_timing.py)."""

    @property
    def pruned_tokens(self) -> int:
        return sum(p.tokens for p in self.new_prunes)


@dataclass(frozen=True)
class PruneResult:
    """A PruneHistory call's outcome."""

    removed: int
    """KV entries removed, summed over layers and kv-heads."""
    pruned_tokens: int
    """History tokens whose KV was pruned."""
    session: SessionInfo


@dataclass(frozen=True)
class ModelInfo:
    """What the engine serves (GetServerInfo, ``/v1/models``)."""

    name: str
    architecture: str
    max_model_len: int
    vocab_size: int
    method: str
    """The engine's default sparse method."""
    fingerprint: str
    """What KV computed here depends on: a snapshot from another fingerprint is recomputed."""
    prune_roles: tuple[str, ...]
    prune_lag: int | None


@dataclass(frozen=True)
class EngineStats:
    """The engine's counters (``LLMEngine.stats``: pages, running / waiting requests, totals) and
    how many sessions it holds in each chain state, read together between two steps."""

    counters: dict[str, int]
    sessions_by_state: dict[str, int]
    """idle, active, host, history -> sessions."""
