"""The settings every call of a client is sent with: its auth metadata, its deadline and its retry policy.

A client (``agent_adapters.client``) holds one ``CallSettings``; each logical call's retry state
(``agent_adapters.retry._Attempts``) reads it. It sits below both, so neither imports the other back.
"""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True)
class RetryPolicy:
    max_attempts: int = 4
    initial_backoff_s: float = 0.1
    max_backoff_s: float = 2.0
    multiplier: float = 2.0

    def backoff(self, attempt: int) -> float:
        """Seconds to wait before attempt ``attempt`` (1-based retries), with jitter."""
        base = min(self.max_backoff_s, self.initial_backoff_s * self.multiplier ** (attempt - 1))
        return base * (0.5 + random.random() / 2)


@dataclass(frozen=True)
class CallSettings:
    """``metadata``: sent with every call (the bearer token, if any); ``timeout_s``: a call's deadline,
    retries included, unless the call gives its own (None: no deadline); ``retry``: how failed
    attempts are retried."""

    metadata: tuple[tuple[str, str], ...] = ()
    timeout_s: float | None = None
    retry: RetryPolicy = RetryPolicy()
