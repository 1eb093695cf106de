"""Agent hints: what an agent tells the engine about its session's rhythm, and their checks.

An agent that ends a turn with a tool call will be back when the tool returns; one that is done
will not. ``SessionHints`` carries that with a turn (field names after Dynamo's
``nvext.agent_hints`` / ``session_control`` and vLLM RFC 52113):

* ``priority``: higher is served first: waiting turns are admitted in priority order, and idle
  sessions of lower priority are demoted from the GPU first;
* ``pin_ttl_s``: keep the session's KV on the GPU for this many seconds after the turn ends (while
  the tool runs); a pinned idle session is never demoted, and the pin lapses by itself;
* ``release``: the agent is done for now: any pin ends with this turn and the session is demoted
  to host memory when the turn ends, freeing its GPU pages for others.

A pin is bounded: its TTL by ``max_pin_ttl_s``, and the pages all pinned sessions hold by
``max_pinned_fraction`` of the pool, so pins cannot starve the sessions that hold none. A hint out
of range is ``InvalidHint``, a pin the pool cannot grant ``PinLimit``; both leave the session as it
was.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from engine.chain.errors import InvalidHint

MAX_PRIORITY = 100
"""Priorities are integers in [-MAX_PRIORITY, MAX_PRIORITY]; 0 is the default."""


@dataclass(frozen=True)
class SessionHints:
    priority: int | None = None
    """None: the session keeps the priority it has (0 until a turn sets one)."""
    pin_ttl_s: float | None = None
    """Seconds the session stays pinned on the GPU after this turn (None: no pin asked)."""
    release: bool = False

    def check(self, max_pin_ttl_s: float) -> None:
        """Raise InvalidHint for a value out of range."""
        p = self.priority
        if p is not None and (isinstance(p, bool) or not isinstance(p, int) or not -MAX_PRIORITY <= p <= MAX_PRIORITY):
            raise InvalidHint(f"priority must be an integer in [-{MAX_PRIORITY}, {MAX_PRIORITY}], not {p!r}")
        ttl = self.pin_ttl_s
        if ttl is not None:
            if isinstance(ttl, bool) or not isinstance(ttl, (int, float)) or not math.isfinite(ttl):
                raise InvalidHint(f"the pin TTL must be a finite number of seconds, not {ttl!r}")
            if not 0 < ttl <= max_pin_ttl_s:
                raise InvalidHint(f"the pin TTL must be in (0, {max_pin_ttl_s:g}] seconds, not {ttl:g}")
            if self.release:
                raise InvalidHint("a turn cannot both pin its session and release it")
