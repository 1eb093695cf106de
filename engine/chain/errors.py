"""Errors of session requests (the sidecar maps each to a gRPC status)."""

from __future__ import annotations


class SessionError(ValueError):
    """A session request that cannot be carried out as asked."""


class SessionNotFound(SessionError):
    pass


class SessionBusy(SessionError):
    """A turn is already running on the session."""


class HistoryMismatch(SessionError):
    """The tokens given do not extend the session's history."""


class TurnIndexMismatch(SessionError):
    """``expected_turn_index`` is not the session's turn index (optimistic concurrency).
    ``turn_index``: the turns the session really holds (None where unknown) and ``expected`` the
    request's expectation, which the sidecar sends back to the client with the refusal."""

    def __init__(self, message: str, turn_index: int | None = None, expected: int | None = None):
        super().__init__(message)
        self.turn_index, self.expected = turn_index, expected


class SessionExists(SessionError):
    """A session id that is already taken (fork target, loaded snapshot)."""


class ContextFull(SessionError):
    """The turn would make the session's history reach ``max_model_len``."""


class InvalidHint(SessionError):
    """An agent hint out of range: a TTL that is not a finite number of seconds in (0, max_pin_ttl_s],
    a priority outside [-MAX_PRIORITY, MAX_PRIORITY], an expected return outside (0,
    MAX_EXPECTED_RETURN_S], a release with a pin or an expected return (INVALID_ARGUMENT)."""


class PinLimit(SessionError):
    """A pin the pool cannot grant: the pinned sessions would hold more than ``max_pinned_fraction`` of
    the KV pool, starving other sessions (RESOURCE_EXHAUSTED)."""
