"""TurnSpec: one turn of a session, everything a caller may say about it, declared once.

``LLMEngine.add_turn`` builds one from its keywords, ``ChainCache.start_turn`` reads it, and the
sidecar builds one from a gRPC or HTTP request. A new per-turn option is a field here, read where
the turn starts (docs/architecture.md, "Adding a per-turn option").
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.chain.hints import SessionHints
from engine.method_spec import MethodSpec
from engine.sampling import SamplingParams


@dataclass(frozen=True)
class TurnSpec:
    """The new tokens of one turn and how to run it."""

    tokens: list[int] = field(default_factory=list)
    """The tokens the turn appends to the session's history (only they are prefilled)."""
    params: SamplingParams = field(default_factory=SamplingParams)
    """How the reply is generated."""
    role: str = "user"
    """The role of ``tokens`` when ``spans`` is not given."""
    spans: list[tuple[int, int, str]] | None = None
    """Role-tagged spans ``(start, end, role)`` of ``tokens`` (the chain's pruning rule reads them)."""
    method: MethodSpec | None = None
    """A new session's sparse method (None: the engine's default); a later turn may only repeat it."""
    expected_turn_index: int | None = None
    """Refuse the turn unless the session is at this turn (None: any)."""
    history: list[int] | None = None
    """The whole history instead of ``tokens``: it must extend the session's, and the rest is the turn."""
    shared_prefix: int = 0
    """How many leading tokens of a first turn are a prompt other sessions share (stored once)."""
    prefix_scope: str = ""
    """Who may share that prefix ("tenant:<name>"; "" for a prefix any session may share)."""
    hints: SessionHints | None = None
    """The agent's priority, pin or release (engine/chain/hints.py)."""
