"""Scheduler: continuous batching with chunked prefill, admission against free pages, preemption.

Each step it packs one forward pass, up to ``max_num_batched_tokens`` tokens:

1. every running sequence: its decode token, or its next prefill chunk (``prefill_chunk_size``);
   when the pool is short of pages, the most recently admitted sequence is preempted, so the
   engine never runs out of memory: a session's KV moves to host memory and comes back when it is
   readmitted (swap), a one-shot request's pages are freed and it is prefilled again (recompute);
2. waiting sequences while their first chunk fits in the free pages with a reservation left for
   one decode step of every running sequence: by priority (an agent hint), resident sessions
   before ones swapped to host memory, shorter prefills first, with a fairness bound
   (``max_bypass``: one overtaken that often goes first). A swapped session is restored after the
   step's forward pass (``swap_in``), so its copy never delays the step's other requests. While
   anything decodes, prefill takes at most ``prefill_tokens_while_decoding`` tokens of a step.

Page needs are counted from the cache's real (possibly compressed) head lengths, so the batch grows
as methods free pages. What the scheduler reclaims beyond its own queues (idle sessions to demote,
a preempted session to swap out, a swapped one to restore) it reaches through the ``Reclaimer``
given at construction (the engine's ChainTiers); nothing points back up to the engine.
"""

from __future__ import annotations

import time
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
    swap_in: list[Sequence] = field(default_factory=list)
    """Sessions admitted from host memory: restored after this step's forward pass (``Scheduler.swap_in``)."""

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

    def swapped(self, seq: Sequence) -> bool:
        """Is ``seq``'s KV in host memory, to be restored when it is admitted?"""

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
        seq.timing.queued(time.monotonic())
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

    def spare_room(self) -> tuple[int, int]:
        """(pages, cache slots) free beyond what every admitted and waiting sequence may still take
        before its turn ends: what may be spent ahead of time (a prefetch) without delaying them.
        A sequence's most is its prompt left to prefill and its ``max_tokens`` left to decode, as if
        its method compressed nothing (an upper bound); one waiting without a cache slot needs one."""
        queued = [*self.running, *self.waiting]
        cached = [s for s in queued if self.manager.has(s.seq_id)]
        need = self.manager.pages_for_append([s.seq_id for s in cached], [_tokens_left(s) for s in cached])
        slots = self.manager.num_free_slots
        for seq in queued:
            if self.manager.has(seq.seq_id):
                continue
            restore = self.reclaimer.restore_pages(seq, _tokens_left(seq)) if self.reclaimer is not None else 0
            need += restore or self.fresh_pages(_tokens_left(seq))
            slots -= 1
        return max(0, self.manager.pool.num_free - need), max(0, slots)

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

        # decodes first, then prefill chunks; while anything decodes, prefill takes at most
        # ``prefill_tokens_while_decoding`` tokens of the step (the decodes keep their pace)
        plan = []  # (sequence, tokens) for every running sequence this step's token budget reaches
        for seq in [s for s in self.running if s.in_decode]:
            if budget <= 0:
                break
            plan.append((seq, 1))
            budget -= 1
        prefill_left = self._prefill_allowance(bool(plan))
        for seq in [s for s in self.running if not s.in_decode]:
            n = self._chunk(seq, min(budget, prefill_left))
            if n <= 0:
                continue
            plan.append((seq, n))
            budget -= n
            prefill_left -= n
        needs = (
            self.manager.pages_for_append_each([s.seq_id for s, _ in plan], [n for _, n in plan]).tolist()
            if plan
            else []
        )
        dropped: set[int] = set()
        placed: set[int] = set()
        for (seq, n), need in zip(plan, needs):
            if id(seq) in dropped:
                continue
            while not self._room(need, reserved):
                victim = self._victim(placed)
                if victim is seq and len(self.running) == 1:
                    # alone and still too large: it can never run in this pool
                    self.running.pop()
                    batch.failed.append((seq, f"the KV pool ({pool.num_pages} pages) cannot hold this sequence"))
                    dropped.add(id(seq))
                    break
                self._preempt(victim, batch)
                dropped.add(id(victim))
                m = next((m for s2, m in plan if s2 is victim), 0)
                budget += m
                if not victim.in_decode:
                    prefill_left += m
                if victim is seq:
                    break
            if id(seq) in dropped:
                continue
            reserved += need
            placed.add(id(seq))
            (batch.decode.append(seq) if seq.in_decode else batch.prefill.append((seq, n)))

        prefill_left = min(prefill_left, self._prefill_allowance(bool(batch.decode)))
        self._admit(batch, budget, prefill_left, reserved)
        return batch

    def _prefill_allowance(self, decoding: bool) -> int:
        cap = self.config.prefill_tokens_while_decoding
        return cap if decoding and cap > 0 else self.config.max_num_batched_tokens

    def _admission_order(self) -> list[Sequence]:
        """The waiting sequences in the order admission tries them: any overtaken ``max_bypass``
        times first (in arrival order), then by priority, resident before swapped to host memory
        (a cold session's swap-in does not hold up a resident one), and fewer tokens to prefill
        first (a short prefill is not stuck behind a long one); ties in arrival order."""
        limit = self.config.max_bypass
        keyed = []
        for i, seq in enumerate(self.waiting):
            if seq.bypassed >= limit:
                keyed.append(((0, i), seq))
                continue
            cold = self.reclaimer is not None and self.reclaimer.swapped(seq)
            keyed.append(((1, -seq.priority, cold, seq.num_to_feed, i), seq))
        keyed.sort(key=lambda kv: kv[0])
        return [seq for _, seq in keyed]

    def _admit(self, batch: ScheduledBatch, budget: int, prefill_left: int, reserved: int) -> None:
        """Admit waiting sequences while their first chunk fits in the free pages with a reservation
        left for one decode step of every running sequence. A session swapped to host memory is
        restored after this step's forward pass (``swap_in``), so the step's other requests do not
        wait for its copy; it joins the next step."""
        pool = self.manager.pool
        order = self._admission_order() if len(self.waiting) > 1 else list(self.waiting)
        position = {id(s): i for i, s in enumerate(self.waiting)}
        last_admitted = -1
        for seq in order:
            if budget <= 0 or prefill_left <= 0:
                break
            if len(self.running) + len(batch.swap_in) >= self.config.max_num_seqs:
                break
            strict = seq.bypassed >= self.config.max_bypass
            n = self._chunk(seq, min(budget, prefill_left))
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
                if self.running or batch.swap_in:
                    if strict:  # it has waited long enough: hold the room for it
                        break
                    continue
                if need > pool.num_free:  # nothing runs that could free pages: it never fits
                    self.waiting.remove(seq)
                    batch.failed.append(
                        (seq, f"the KV pool ({pool.num_pages} pages) cannot hold a chunk of this sequence")
                    )
                    continue
            self.waiting.remove(seq)
            last_admitted = max(last_admitted, position[id(seq)])
            reserved += need
            if restore:
                batch.swap_in.append(seq)
                continue
            if not cached:
                self.manager.open(seq.seq_id)
                self.controller.admit(SeqInfo(seq.seq_id, seq.num_cached, seq.protected_len), seq.spec)
            seq.status = SeqStatus.RUNNING
            seq.timing.admitted(time.monotonic())
            self.running.append(seq)
            budget -= n
            prefill_left -= n
            batch.prefill.append((seq, n))
        for seq in self.waiting:  # overtaken by a later arrival
            if position[id(seq)] < last_admitted:
                seq.bypassed += 1

    def swap_in(self, batch: ScheduledBatch) -> None:
        """Restore the sessions ``schedule`` admitted from host memory (after the step's forward pass);
        they run from the next step. One that no longer fits waits again, first in line."""
        for seq in batch.swap_in:
            t0 = time.monotonic()
            need = self.reclaimer.restore_pages(seq, 0)
            slot = self.manager.num_free_slots > 0 or self.reclaimer.reclaim_slot()
            if not slot or not self._room(need, 0):
                seq.bypassed = max(seq.bypassed, self.config.max_bypass)
                self.waiting.appendleft(seq)
                continue
            seq.timing.admitted(t0)
            self.reclaimer.restore(seq)
            seq.timing.swap_in_s += time.monotonic() - t0
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
        batch.swap_in = []

    def _victim(self, placed: set[int]) -> Sequence:
        """The running sequence to preempt: not yet placed in this step's batch, lowest priority,
        most recently admitted."""
        candidates = [(s.priority, -i, s) for i, s in enumerate(self.running) if id(s) not in placed]
        return min(candidates, key=lambda c: c[:2])[2]

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
        seq.timing.queued(time.monotonic())
        self.waiting.appendleft(seq)
        self.preemptions += 1
        batch.preempted.append(seq)


def _tokens_left(seq: Sequence) -> int:
    """Tokens ``seq`` may still add to its cache this turn: its prompt left to prefill, then its
    ``max_tokens`` left to decode."""
    return seq.num_to_feed + max(0, seq.params.max_tokens - len(seq.output_ids))
