"""Per-tenant limits: how many live sessions a tenant may hold on a replica, and how many tokens a turn may take.

* ``max_sessions_per_tenant``: sessions of one tenant held on this replica (on the accelerator, in
  host RAM or as history, running or not). A Turn that would start or load one more, a Resume of
  a session not held here, or a ForkSession beyond it get ``RESOURCE_EXHAUSTED`` (the tenant's
  quota; ending or idling out sessions frees it). Sessions only in the store do not count.
* ``max_tokens_per_turn``: a Turn's ``max_tokens`` above it, or new messages that render to more
  prompt tokens than it, get ``INVALID_ARGUMENT`` (the request is too large as asked); a Turn that
  leaves ``max_tokens`` unset gets at most this many.

With auth off every caller is the anonymous tenant ``""``, so the limits apply to the replica
as a whole. None (the default) means no limit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable

if TYPE_CHECKING:  # pragma: no cover
    from sidecar.sessions import Session


class QuotaExceeded(RuntimeError):
    """The tenant holds as many sessions as it may (RESOURCE_EXHAUSTED)."""


class TurnTooLarge(ValueError):
    """A turn asks for more tokens than a tenant's turn may take (INVALID_ARGUMENT)."""


@dataclass
class TenantLimits:
    max_sessions_per_tenant: int | None = None
    max_tokens_per_turn: int | None = None

    def __post_init__(self):
        for name in ("max_sessions_per_tenant", "max_tokens_per_turn"):
            v = getattr(self, name)
            if v is not None and v < 1:
                raise ValueError(f"{name} must be at least 1 (or unset), not {v}")

    @staticmethod
    def tenant_of(key: str) -> str:
        return key.rsplit("/", 1)[0] if "/" in key else ""

    def held(self, tenant: str, sessions: Iterable["Session"], exclude: str | None = None) -> int:
        return sum(1 for s in sessions
                   if (s.in_engine or s.busy) and s.key != exclude and self.tenant_of(s.key) == tenant)

    def check_new_session(self, tenant: str, sessions: Iterable["Session"], exclude: str | None = None) -> None:
        """Raise QuotaExceeded when ``tenant`` already holds its most sessions (``exclude``: the
        session being started, already registered)."""
        n = self.max_sessions_per_tenant
        if n is not None and self.held(tenant, sessions, exclude) >= n:
            who = f"tenant {tenant!r}" if tenant else "this sidecar"
            raise QuotaExceeded(f"{who} holds {n} session(s), its limit; end one (EndSession) or retry later")

    def check_max_tokens(self, max_tokens: int, was_set: bool) -> int:
        """The turn's max_tokens under the limit (an unset one is clipped to it)."""
        n = self.max_tokens_per_turn
        if n is None or max_tokens <= n:
            return max_tokens
        if not was_set:
            return n
        raise TurnTooLarge(f"max_tokens {max_tokens} is above this tenant's limit of {n} tokens per turn")

    def check_prompt(self, prompt_tokens: int) -> None:
        n = self.max_tokens_per_turn
        if n is not None and prompt_tokens > n:
            raise TurnTooLarge(f"the turn's new messages are {prompt_tokens} tokens; the limit is {n} tokens per turn")
