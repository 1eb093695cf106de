"""Where one request's (or session turn's) time went, from the engine's own clock.

The step loop and the scheduler fill a ``TurnTiming`` as the request moves: how long it waited in
the queue (admission or free memory), how long its session's KV took to come back from host memory
(swap-in), and the wall time of the steps it took part in, split by what the request did in them:
prefilling its new tokens, re-prefilling history it had lost (recompute), decoding, and the part of
a decode step that the prefill chunks sharing it cost (a decode stalled behind prefill). Only
``time.monotonic()`` is read, never a device sync: on a GPU a step's wall time is the host's, which
includes the device work wherever the step reads its sampled tokens back (every step that is not
run ahead).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass
class TurnTiming:
    arrival: float = field(default_factory=time.monotonic)
    """When the request (turn) was queued."""
    admitted_at: float | None = None
    """When it was first admitted to the running batch."""
    first_token_at: float | None = None
    finished_at: float | None = None
    waiting_s: float = 0.0
    """Time in the waiting queue: before admission, and again after any preemption."""
    swap_in_s: float = 0.0
    """Restoring its session's KV from host memory (host -> device)."""
    prefill_s: float = 0.0
    """Wall time of the steps that prefilled this turn's new tokens."""
    recompute_s: float = 0.0
    """Wall time of the steps that re-prefilled history whose KV was lost (history tier, preemption)."""
    decode_s: float = 0.0
    """Wall time of its decode steps, less the share of them the prefill chunks in the same step took."""
    decode_stall_s: float = 0.0
    """That share: decode steps stretched by prefill chunks of other requests sharing the step."""
    recompute_tokens: int = 0
    """History tokens prefilled again (their KV was lost)."""
    decode_steps: int = 0
    _waiting_since: float | None = None

    # --- the engine's side -------------------------------------------------------------------------
    def queued(self, now: float) -> None:
        self._waiting_since = now

    def admitted(self, now: float) -> None:
        if self._waiting_since is not None:
            self.waiting_s += now - self._waiting_since
            self._waiting_since = None
        if self.admitted_at is None:
            self.admitted_at = now

    def prefill_step(self, seconds: float, tokens: int, recompute: int) -> None:
        """A step that prefilled ``tokens`` of this request, ``recompute`` of them lost history."""
        share = recompute / tokens if tokens else 0.0
        self.recompute_s += seconds * share
        self.prefill_s += seconds * (1.0 - share)
        self.recompute_tokens += recompute

    def decode_step(self, seconds: float, prefill_share: float) -> None:
        """A decode step of ``seconds``; ``prefill_share``: the fraction of its tokens that were prefill."""
        self.decode_stall_s += seconds * prefill_share
        self.decode_s += seconds * (1.0 - prefill_share)
        self.decode_steps += 1

    # --- reading it --------------------------------------------------------------------------------
    @property
    def total_s(self) -> float:
        end = self.finished_at if self.finished_at is not None else time.monotonic()
        return end - self.arrival

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_at is None else self.first_token_at - self.arrival

    @property
    def other_s(self) -> float:
        """The rest of the request's time: the engine loop between steps, and steps it waited in
        the batch without taking part."""
        parts = self.waiting_s + self.swap_in_s + self.prefill_s + self.recompute_s + self.decode_s
        return max(0.0, self.total_s - parts - self.decode_stall_s)

    def breakdown(self) -> dict[str, float]:
        """Seconds by cause (the keys the benchmarks report)."""
        return {
            "waiting_s": self.waiting_s,
            "swap_in_s": self.swap_in_s,
            "recompute_s": self.recompute_s,
            "prefill_s": self.prefill_s,
            "decode_s": self.decode_s,
            "decode_stall_s": self.decode_stall_s,
            "other_s": self.other_s,
        }
