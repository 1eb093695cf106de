"""The agent hints benchmarks/agent_trace.py sends in its ``+hints`` configurations, as an agent
framework would send them (engine/chain/hints.py; the client's ``HINT_FIELDS``):

* ``priority`` with every turn (``--hint-priority``; the same for every session of the run, so it
  orders these sessions' turns only against other traffic);
* a pin with a turn whose reply the agent answers with a tool result (every turn but the last of
  the trace's sessions): its TTL is the tool's run time (the think time before the next turn) plus
  ``--pin-slack-s``, at most the server's ``max_pin_ttl_s``; the session stays on the GPU while the
  tool runs;
* ``expected_return_s`` with the same turns: the tool's run time, as an agent that knows its tools'
  usual times would say it; a session demoted meanwhile (its pin refused, or pins off on the server:
  ``--max-pin-ttl-s 0``) is prefetched onto the GPU before the tool returns (the engine's
  ``prefetches`` / ``prefetch_hits`` counters, in ``--profile``'s counters, say how often);
* ``release`` with the session's last turn: the agent is done. The trace then ends the session
  (EndSession) as every configuration does, so the release only shows its cost (the session's KV
  moved to host memory when the turn ends, freed a moment later).

A pin the server cannot grant (``RESOURCE_EXHAUSTED``: the pool's pin share or the tenant's pin
quota is taken) refuses the turn with the session untouched; the agent then sends the turn again
without the pin (its expected return kept), as a framework would, and the turn's record says so.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Awaitable, Callable

import grpc

from agent_adapters.retry import ChainKVError
from engine.chain.hints import MAX_EXPECTED_RETURN_S


@dataclass(frozen=True)
class TurnHints:
    """The hints one turn carries (None / False: not sent)."""

    priority: int | None = None
    pin_ttl_s: float | None = None
    release: bool = False
    expected_return_s: float | None = None
    pin_refused: bool = False
    """The server refused the pin and the turn went again without it."""

    def options(self) -> dict:
        """The Turn options (agent_adapters.turns.HINT_FIELDS) that send these hints."""
        out = {
            "priority": self.priority,
            "pin_ttl_s": self.pin_ttl_s,
            "release": self.release or None,
            "expected_return_s": self.expected_return_s,
        }
        return {k: v for k, v in out.items() if v is not None}

    def record(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class HintPolicy:
    priority: int | None = 1
    pin_slack_s: float = 1.0
    max_pin_ttl_s: float = 600.0
    """The server's longest pin (engine setting ``max_pin_ttl_s``); 0: pins are off there."""

    def for_turn(self, turn: int, thinks: list[float]) -> TurnHints:
        """The hints of turn ``turn`` of a session whose think times (the tool's run time before each
        turn) are ``thinks``: a pin while the next turn's tool runs and the tool's run time as the
        expected return, a release on the last turn."""
        if turn == len(thinks) - 1:
            return TurnHints(priority=self.priority, release=True)
        tool_s = thinks[turn + 1]
        back = min(tool_s, MAX_EXPECTED_RETURN_S) if tool_s > 0 else None
        if self.max_pin_ttl_s <= 0:
            return TurnHints(priority=self.priority, expected_return_s=back)
        pin = min(self.max_pin_ttl_s, tool_s + self.pin_slack_s)
        return TurnHints(priority=self.priority, pin_ttl_s=pin, expected_return_s=back)


async def send_turn(run: Callable[[dict], Awaitable[dict]], hints: TurnHints | None) -> tuple[dict, TurnHints | None]:
    """``run(options)`` with the hints' Turn options; a pin the server refuses (RESOURCE_EXHAUSTED)
    is dropped and the turn sent again. Returns the turn's row and the hints it went with."""
    if hints is None:
        return await run({}), None
    try:
        return await run(hints.options()), hints
    except ChainKVError as e:
        if hints.pin_ttl_s is None or e.code != grpc.StatusCode.RESOURCE_EXHAUSTED:
            raise
    sent = TurnHints(priority=hints.priority, expected_return_s=hints.expected_return_s, pin_refused=True)
    return await run(sent.options()), sent
