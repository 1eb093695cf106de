"""Scheduling in lockstep: page accounting every rank agrees on, and a check of each step's plan.

Every rank runs the same scheduler and chain cache over the same requests (rank 0 broadcasts every
engine call, engine/tensor_parallel/driver.py), so their decisions agree as long as the numbers they
decide on agree. Two of those numbers are per rank: a rank's pool holds only its own kv-heads,
and methods with per-head budgets (adakv, duo_attention, ...) leave different heads, hence
different ranks, with different page counts. The scheduler and the chain cache therefore read
the pool through a :class:`CapacityView`: free pages are the minimum over ranks, the pages an
append or a restore needs the maximum. Each read is one small all-reduce; by induction every rank
takes the same branch, so the collectives line up, and a step fits on every rank when it fits.

:func:`check_plans` hashes each step's plan (who decodes, who prefills how many tokens, who was
preempted or failed) and compares it across ranks: ranks that diverge stop with an error rather
than run different batches.
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch

from engine.distributed import group


class _PoolView:
    def __init__(self, pool):
        self._pool = pool

    @property
    def num_free(self) -> int:
        return group.min_ints([self._pool.num_free])[0]

    def __getattr__(self, name: str) -> Any:
        return getattr(self._pool, name)


class CapacityView:
    """A CacheManager whose capacity reads are agreed over ranks; everything else is the rank's own."""

    def __init__(self, manager):
        self._manager = manager
        self.pool = _PoolView(manager.pool)

    def pages_for_append_each(self, seq_ids, counts) -> torch.Tensor:
        local = self._manager.pages_for_append_each(seq_ids, counts)
        return torch.tensor(group.max_ints(local.tolist()), dtype=local.dtype)

    def pages_for_append(self, seq_ids, counts) -> int:
        return int(self.pages_for_append_each(seq_ids, counts).sum()) if seq_ids else 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._manager, name)


def _agreed_restore_pages(restore_pages):
    def agreed(*args, **kwargs) -> int:
        return group.max_ints([restore_pages(*args, **kwargs)])[0]

    return agreed


def plan_digest(batch) -> int:
    """A stable 63-bit hash of a scheduled batch (ids hashed by repr: python's hash() is salted)."""
    parts = [
        ("d", [repr(s.seq_id) for s in batch.decode]),
        ("p", [(repr(s.seq_id), n) for s, n in batch.prefill]),
        ("x", [repr(s.seq_id) for s in batch.preempted]),
        ("f", [repr(s.seq_id) for s, _ in batch.failed]),
        ("s", [repr(s.seq_id) for s in batch.swap_in]),
    ]
    return int.from_bytes(hashlib.blake2b(repr(parts).encode(), digest_size=8).digest(), "little") >> 1


def check_plans(batch) -> None:
    """Raise TensorParallelError unless every rank scheduled the same batch."""
    h = plan_digest(batch)
    hi, neg_lo = group.max_ints([h, -h])
    if hi != -neg_lo:
        raise group.TensorParallelError(
            f"rank {group.rank()} scheduled a different step than another rank (plan {h:x}); the ranks diverged"
        )


def install(engine) -> None:
    """Route ``engine``'s scheduler and chain cache (its tiers: reclaiming, restoring) through agreed
    capacity and checked plans. The step loop keeps the rank's own manager (it only releases)."""
    view = CapacityView(engine.manager)
    engine.scheduler.manager = view
    engine.chains.manager = view
    tiers = engine.chains.tiers  # the scheduler's reclaimer
    tiers.manager = view
    tiers.restore_pages = _agreed_restore_pages(tiers.restore_pages)
    schedule = engine.scheduler.schedule

    def checked_schedule():
        batch = schedule()
        check_plans(batch)
        return batch

    engine.scheduler.schedule = checked_schedule
