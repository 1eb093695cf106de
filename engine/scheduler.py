"""Scheduler: continuous batching with chunked prefill, admission against free pages, preemption.

Each step it packs one forward pass, up to ``max_num_batched_tokens`` tokens:

1. every running sequence: its decode token, or its next prefill chunk (``prefill_chunk_size``);
   when the pool is short of pages, the most recently admitted sequence is preempted, so the
   engine never runs out of memory: a session's KV moves to host memory and comes back when it is
   readmitted (swap), a one-shot request's pages are freed and it is prefilled again (recompute);
2. waiting sequences, first come first served, while their first chunk fits in the free pages
   with a reservation left for one decode step of every running sequence.

Page needs are counted from the cache's real (possibly compressed) head lengths, so the batch grows
as methods free pages. What the scheduler reclaims beyond its own queues (idle sessions to demote,
a preempted session to swap out, a swapped one to restore) it reaches through the ``Reclaimer``
given at construction (the engine's ChainTiers); nothing points back up to the engine.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Protocol

from engine.cache.manager import CacheManager
from engine.config import EngineConfig
from engine.controller import SparseController
from engine.lifecycle import SeqInfo
from engine.sequence import Sequence, SeqStatus


@dataclass
class ScheduledBatch:
    decode: list[Sequence] = field(default_factory=list)
    prefill: list[tuple[Sequence, int]] = field(default_factory=list)
    """(sequence, tokens to prefill this step)."""
    preempted: list[Sequence] = field(default_factory=list)
    failed: list[tuple[Sequence, str]] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not self.decode and not self.prefill

    @property
    def num_tokens(self) -> int:
        return len(self.decode) + sum(n for _, n in self.prefill)


class Reclaimer(Protocol):
    """Cached state beyond the running batch that the scheduler may reclaim (session chains)."""

    def reclaim(self, pages: int) -> int:
        """Free at least ``pages`` pages if idle state allows; returns the pages freed."""

    def reclaim_slot(self) -> bool:
        """Free one cache slot; False if nothing idle holds one."""

    def restore_pages(self, seq: Sequence, n_new: int) -> int:
        """Pages that restoring ``seq``'s swapped-out KV and appending ``n_new`` tokens take (0: nothing to restore)."""

    def restore(self, seq: Sequence) -> None:
        """Bring ``seq``'s swapped-out KV back (it has a cache slot and pages again)."""

    def swap_out(self, seq: Sequence) -> bool:
        """Move a preempted ``seq``'s KV off the device; False if it cannot (the scheduler drops it)."""

    def preempted(self, seq: Sequence) -> None:
        """``seq`` lost its KV to preemption and will be prefilled again."""


class Scheduler:
    def __init__(
        self,
        config: EngineConfig,
        manager: CacheManager,
        controller: SparseController,
        reclaimer: Reclaimer | None = None,
    ):
        self.config = config
        self.manager = manager
        self.controller = controller
        self.reclaimer = reclaimer
        """Idle sessions to demote, preempted sessions to swap (None: one-shot requests only)."""
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.preemptions = 0
        self.swaps = 0
        """Preemptions that moved a session's KV to host memory instead of dropping it."""
        self._pages_per_step = manager.pages_for_new(1)  # the most pages one decode step of one sequence can take

    # --- queue --------------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        seq.status = SeqStatus.WAITING
        self.waiting.append(seq)

    def remove(self, seq: Sequence) -> None:
        """Take a sequence out of the queues (finished or aborted); the caller releases its cache."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def fresh_pages(self, n: int) -> int:
        return self.manager.pages_for_new(n)

    # --- one step -----------------------------------------------------------------------------
    def _chunk(self, seq: Sequence, budget: int) -> int:
        n = min(seq.num_to_feed, self.config.prefill_chunk_size, budget)
        if seq.prefix_boundary > seq.num_cached:  # stop at a shared prefix's end (a holder is made there)
            n = min(n, seq.prefix_boundary - seq.num_cached)
        return n

    def _room(self, need: int, reserved: int) -> bool:
        """Is there room for ``need`` more pages? Idle sessions are demoted to make it."""
        short = need - (self.manager.pool.num_free - reserved)
        if short > 0 and self.reclaimer is not None:
            self.reclaimer.reclaim(short)
        return need <= self.manager.pool.num_free - reserved

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.config.max_num_batched_tokens
        reserved = 0
        pool = self.manager.pool

        plan = []  # (sequence, tokens) for every running sequence this step's token budget reaches
        for seq in self.running:
            if budget <= 0:
                break
            n = 1 if seq.in_decode else self._chunk(seq, budget)
            plan.append((seq, n))
            budget -= n
        needs = (
            self.manager.pages_for_append_each([s.seq_id for s, _ in plan], [n for _, n in plan]).tolist()
            if plan
            else []
        )
        dropped: set[int] = set()
        for (seq, n), need in zip(plan, needs):
            if id(seq) in dropped:
                continue
            while not self._room(need, reserved):
                victim = self.running[-1]
                if victim is seq and self.running[0] is seq:
                    # alone and still too large: it can never run in this pool
                    self.running.pop()
                    batch.failed.append((seq, f"the KV pool ({pool.num_pages} pages) cannot hold this sequence"))
                    dropped.add(id(seq))
                    break
                self._preempt(victim, batch)
                dropped.add(id(victim))
                budget += next((m for s2, m in plan if s2 is victim), 0)
                if victim is seq:
                    break
            if id(seq) in dropped:
                continue
            reserved += need
            (batch.decode.append(seq) if seq.in_decode else batch.prefill.append((seq, n)))

        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            n = self._chunk(seq, budget)
            cached = self.manager.has(seq.seq_id)
            restore = 0 if cached or self.reclaimer is None else self.reclaimer.restore_pages(seq, n)
            if not cached and self.manager.num_free_slots == 0:
                if self.reclaimer is None or not self.reclaimer.reclaim_slot():
                    break
            if cached:
                need = self.manager.pages_for_append([seq.seq_id], [n])
            else:
                need = restore or self.fresh_pages(n)
            reserve = self._pages_per_step * len(self.running)
            if not self._room(need + reserve, reserved):
                if self.running:
                    break
                if need > pool.num_free:  # nothing runs that could free pages: it never fits
                    self.waiting.popleft()
                    batch.failed.append(
                        (seq, f"the KV pool ({pool.num_pages} pages) cannot hold a chunk of this sequence")
                    )
                    continue
            self.waiting.popleft()
            if not cached:
                if restore:
                    self.reclaimer.restore(seq)
                else:
                    self.manager.open(seq.seq_id)
                    self.controller.admit(SeqInfo(seq.seq_id, seq.num_cached, seq.protected_len), seq.spec)
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            reserved += need
            budget -= n
            batch.prefill.append((seq, n))
        return batch

    def _preempt(self, seq: Sequence, batch: ScheduledBatch) -> None:
        """Make room by taking ``seq`` out of the batch: a session's KV goes to host memory and comes
        back when it is readmitted (nothing is recomputed); a one-shot request's is dropped and
        prefilled again."""
        self.running.remove(seq)
        if self.reclaimer is not None and self.reclaimer.swap_out(seq):
            seq.status = SeqStatus.WAITING
            seq.counters.preemptions += 1
            self.swaps += 1
        else:
            if self.reclaimer is not None:
                self.reclaimer.preempted(seq)
            self.manager.release(seq.seq_id)
            self.controller.release(seq.seq_id)
            seq.reset_for_recompute()
        self.waiting.appendleft(seq)
        self.preemptions += 1
        batch.preempted.append(seq)
