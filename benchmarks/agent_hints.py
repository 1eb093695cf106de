"""The agent hints benchmarks/agent_trace.py sends in its ``+hints`` configurations, as an agent
framework would send them (engine/chain/hints.py; the client's ``HINT_FIELDS``):

* ``priority`` with every turn (``--hint-priority``; the same for every session of the run, so it
  orders these sessions' turns only against other traffic);
* a pin with a turn whose reply the agent answers with a tool result (every turn but the last of
  the trace's sessions): its TTL is the tool's run time (the think time before the next turn) plus
  ``--pin-slack-s``, at most the server's ``max_pin_ttl_s``; the session stays on the GPU while the
  tool runs;
* ``release`` with the session's last turn: the agent is done. The trace then ends the session
  (EndSession) as every configuration does, so the release only shows its cost (the session's KV
  moved to host memory when the turn ends, freed a moment later).

A pin the server cannot grant (``RESOURCE_EXHAUSTED``: the pool's pin share or the tenant's pin
quota is taken) refuses the turn with the session untouched; the agent then sends the turn again
without the pin, as a framework would, and the turn's record says so.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Awaitable, Callable

import grpc

from agent_adapters.retry import ChainKVError


@dataclass(frozen=True)
class TurnHints:
    """The hints one turn carries (None / False: not sent)."""

    priority: int | None = None
    pin_ttl_s: float | None = None
    release: bool = False
    pin_refused: bool = False
    """The server refused the pin and the turn went again without it."""

    def options(self) -> dict:
        """The Turn options (agent_adapters.turns.HINT_FIELDS) that send these hints."""
        out = {"priority": self.priority, "pin_ttl_s": self.pin_ttl_s, "release": self.release or None}
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
        turn) are ``thinks``: a pin while the next turn's tool runs, a release on the last turn."""
        if turn == len(thinks) - 1:
            return TurnHints(priority=self.priority, release=True)
        if self.max_pin_ttl_s <= 0:
            return TurnHints(priority=self.priority)
        return TurnHints(priority=self.priority, pin_ttl_s=min(self.max_pin_ttl_s, thinks[turn + 1] + self.pin_slack_s))


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
    sent = TurnHints(priority=hints.priority, pin_refused=True)
    return await run(sent.options()), sent
