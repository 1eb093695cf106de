"""Per-tenant limits: how many live sessions a tenant may hold on a replica, and how many tokens a turn may take.

* ``max_sessions_per_tenant``: sessions of one tenant held on this replica (on the accelerator, in
  host RAM or as history, running or not). A Turn that would start or load one more, a Resume of
  a session not held here, or a ForkSession beyond it get ``RESOURCE_EXHAUSTED`` (the tenant's
  quota; ending or idling out sessions frees it). Sessions only in the store do not count.
* ``max_tokens_per_turn``: a Turn's ``max_tokens`` above it, or new messages that render to more
  prompt tokens than it, get ``INVALID_ARGUMENT`` (the request is too large as asked); a Turn that
  leaves ``max_tokens`` unset gets at most this many.

With auth off every caller is the anonymous tenant ``""``, so the limits apply to the replica
as a whole. None (the default) means no limit. ``--tenant-limit TENANT:KEY=N[,KEY=N]`` gives one
tenant its own values (``--tenant-limit batch:max_sessions_per_tenant=512,max_tokens_per_turn=8192``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable

from sidecar.session_ids import SessionKey
from sidecar.settings import setting

if TYPE_CHECKING:  # pragma: no cover
    from sidecar.sessions.record import Session


class QuotaExceeded(RuntimeError):
    """The tenant holds as many sessions as it may (RESOURCE_EXHAUSTED)."""


class TurnTooLarge(ValueError):
    """A turn asks for more tokens than a tenant's turn may take (INVALID_ARGUMENT)."""


LIMIT_KEYS = ("max_sessions_per_tenant", "max_tokens_per_turn", "max_pinned_sessions_per_tenant")


def parse_overrides(items: Iterable[str]) -> dict[str, dict[str, int]]:
    """``TENANT:KEY=N[,KEY=N]`` items (``--tenant-limit``) -> overrides."""
    out: dict[str, dict[str, int]] = {}
    for item in items:
        tenant, sep, rest = item.partition(":")
        pairs = [p.partition("=") for p in rest.split(",") if p.strip()]
        if not sep or not pairs or any(not eq for _, eq, _ in pairs):
            raise ValueError(f"--tenant-limit expects TENANT:KEY=N[,KEY=N], got {item!r}")
        try:
            out.setdefault(tenant.strip(), {}).update({k.strip(): int(v) for k, _, v in pairs})
        except ValueError:
            raise ValueError(f"--tenant-limit {item!r}: values must be integers") from None
    return out


@dataclass
class TenantLimits:
    max_sessions_per_tenant: int | None = setting(
        None, "live sessions one tenant may hold here (more: RESOURCE_EXHAUSTED)", metavar="N"
    )
    max_tokens_per_turn: int | None = setting(
        None, "max_tokens and new prompt tokens one turn may take (more: INVALID_ARGUMENT)", metavar="N"
    )
    max_pinned_sessions_per_tenant: int | None = setting(
        None,
        "sessions one tenant may pin on the accelerator at once with agent hints (more: RESOURCE_EXHAUSTED)",
        metavar="N",
    )
    """None: no per-tenant bound on pins (the engine's max_pinned_fraction still holds)."""
    overrides: dict[str, dict[str, int]] = setting(
        {},
        "one tenant's own max_sessions_per_tenant / max_tokens_per_turn / max_pinned_sessions_per_tenant (repeatable)",
        metavar="TENANT:KEY=N[,KEY=N]",
        name="tenant_limit",
        parse=parse_overrides,
    )
    """tenant -> its own values for some of LIMIT_KEYS."""

    def __post_init__(self):
        for values in [{k: getattr(self, k) for k in LIMIT_KEYS}, *self.overrides.values()]:
            for name, v in values.items():
                if name not in LIMIT_KEYS:
                    raise ValueError(f"unknown tenant limit {name!r}; use {', '.join(LIMIT_KEYS)}")
                if v is not None and v < 1:
                    raise ValueError(f"{name} must be at least 1 (or unset), not {v}")

    def limit(self, tenant: str, name: str) -> int | None:
        own = self.overrides.get(tenant, {})
        return own[name] if name in own else getattr(self, name)

    def held(self, tenant: str, sessions: Iterable["Session"], exclude: str | None = None) -> int:
        return sum(
            1
            for s in sessions
            if (s.in_engine or s.busy) and s.key != exclude and SessionKey.tenant_of(s.key) == tenant
        )

    def check_new_session(self, tenant: str, sessions: Iterable["Session"], exclude: str | None = None) -> None:
        """Raise QuotaExceeded when ``tenant`` already holds its most sessions (``exclude``: the
        session being started, already registered)."""
        n = self.limit(tenant, "max_sessions_per_tenant")
        if n is not None and self.held(tenant, sessions, exclude) >= n:
            who = f"tenant {tenant!r}" if tenant else "this sidecar"
            raise QuotaExceeded(f"{who} holds {n} session(s), its limit; end one (EndSession) or retry later")

    def check_pin(self, tenant: str, sessions: Iterable["Session"], exclude: str, now: float) -> None:
        """Raise QuotaExceeded when ``tenant`` already holds its most live pins (``exclude``: the
        session asking, whose own pin is renewed, not added)."""
        n = self.limit(tenant, "max_pinned_sessions_per_tenant")
        if n is None:
            return
        held = sum(
            1 for s in sessions if s.key != exclude and s.pinned_until > now and SessionKey.tenant_of(s.key) == tenant
        )
        if held >= n:
            who = f"tenant {tenant!r}" if tenant else "this sidecar"
            raise QuotaExceeded(
                f"{who} has {n} pinned session(s), its limit; release one (session_control release) or let a pin expire"
            )

    def check_max_tokens(self, tenant: str, max_tokens: int, was_set: bool) -> int:
        """The turn's max_tokens under the limit (an unset one is clipped to it)."""
        n = self.limit(tenant, "max_tokens_per_turn")
        if n is None or max_tokens <= n:
            return max_tokens
        if not was_set:
            return n
        raise TurnTooLarge(f"max_tokens {max_tokens} is above the limit of {n} tokens per turn")

    def check_prompt(self, tenant: str, prompt_tokens: int) -> None:
        n = self.limit(tenant, "max_tokens_per_turn")
        if n is not None and prompt_tokens > n:
            raise TurnTooLarge(f"the turn's new messages are {prompt_tokens} tokens; the limit is {n} tokens per turn")
