"""Agent hints: what an agent tells the engine about its session's rhythm, and their checks.

An agent that ends a turn with a tool call will be back when the tool returns; one that is done
will not. ``SessionHints`` carries that with a turn (field names after Dynamo's
``nvext.agent_hints`` / ``session_control`` and vLLM RFC 52113):

* ``priority``: higher is served first: waiting turns are admitted in priority order, and idle
  sessions of lower priority are demoted from the GPU first;
* ``pin_ttl_s``: keep the session's KV on the GPU for this many seconds after the turn ends (while
  the tool runs); a pinned idle session is never demoted, and the pin lapses by itself;
* ``release``: the agent is done for now: any pin ends with this turn and the session is demoted
  to host memory when the turn ends, freeing its GPU pages for others;
* ``expected_return_s``: the agent expects its next turn about this many seconds after this one
  ends (its tool's usual run time). A session demoted to host memory meanwhile (no pin, a pin that
  lapsed or was refused) is brought back onto the GPU shortly before then, when the pool has pages
  no admitted or waiting turn needs (``ChainTiers.prefetch``), so the next turn's time to first
  token does not include the copy back. KVFlow's prefetch of an agent's KV ahead of its next step;
  Dynamo's ``agent_hints`` carries such predictions (``osl``, the expected output length), and vLLM
  RFC 52113 lists "an offloaded branch will be resumed and can be prefetched" among its cases; none
  names a field for it, so this one says what it is.

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
MAX_EXPECTED_RETURN_S = 3600.0
"""The furthest an expected return may lie (an agent away longer is not waiting on a tool)."""


@dataclass(frozen=True)
class SessionHints:
    priority: int | None = None
    """None: the session keeps the priority it has (0 until a turn sets one)."""
    pin_ttl_s: float | None = None
    """Seconds the session stays pinned on the GPU after this turn (None: no pin asked)."""
    release: bool = False
    expected_return_s: float | None = None
    """Seconds after this turn the agent expects its next one (None: not said)."""

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
        back = self.expected_return_s
        if back is not None:
            if isinstance(back, bool) or not isinstance(back, (int, float)) or not math.isfinite(back):
                raise InvalidHint(f"the expected return must be a finite number of seconds, not {back!r}")
            if not 0 < back <= MAX_EXPECTED_RETURN_S:
                raise InvalidHint(
                    f"the expected return must be in (0, {MAX_EXPECTED_RETURN_S:g}] seconds, not {back:g}"
                )
            if self.release:
                raise InvalidHint("a turn cannot both release its session and expect to return to it")
