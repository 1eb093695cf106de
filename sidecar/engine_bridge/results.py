"""What ``EngineClient`` hands back about a turn across the engine-thread boundary: typed, frozen values.

The engine streams ``RequestOutput`` objects whose token list it keeps appending to; a live list
read on another thread races the engine. The client copies each output, on the engine thread, into
the values here. The engine's own reports (``SessionInfo``, ``PruneRecord``, ``ModelInfo``,
``EngineStats``) are already typed and frozen (engine/api.py) and cross unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.api import PruneRecord, SessionInfo, TurnTiming


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
