"""Tier moves of session chains: GPU pages <-> host RAM <-> the history alone.

``ChainTiers`` is what the Scheduler reclaims through (its ``Reclaimer`` protocol): it demotes
idle chains (least recently used first) to host RAM when the pool or the cache slots run short,
swaps a preempted running session's KV out to host memory, and restores a chain's host copy when
its sequence is admitted again. Past ``host_cache_gb`` host copies are dropped, least recently
used first, to the token history alone (the next turn re-prefills it).
"""

from __future__ import annotations

from typing import Hashable

import torch

from engine.cache.manager import CacheManager
from engine.cache.snapshot import SessionSnapshot
from engine.cache.transfer import ceil_div
from engine.chain.errors import SessionError
from engine.chain.records import Chain, ChainState, Tier
from engine.controller import SparseController
from engine.lifecycle import SeqInfo
from engine.prefix import PrefixIndex
from engine.sequence import Sequence


class ChainTiers:
    def __init__(
        self,
        chains: dict[Hashable, Chain],
        manager: CacheManager,
        controller: SparseController,
        prefixes: PrefixIndex,
        host_limit: int,
    ):
        self.chains = chains
        """The session chains (shared with the ChainCache that owns them)."""
        self.manager = manager
        self.controller = controller
        self.prefixes = prefixes
        self.host_limit = host_limit
        self.host_bytes = 0
        self.demotions = 0
        self.swaps = 0

    # --- the scheduler's side (Reclaimer) ---------------------------------------------------------
    def reclaim(self, pages: int) -> int:
        """Free at least ``pages`` pages if idle state allows: idle prefix holders, then idle chains
        (least recently used first) demoted to host RAM. Returns the pages freed."""
        freed = 0
        while freed < pages:
            n = self.prefixes.drop_idle()
            if n == 0:
                break
            freed += n
        for chain in sorted(self._idle(), key=lambda c: c.last_used):
            if freed >= pages:
                break
            before = self.manager.pool.num_free
            self.demote(chain)
            freed += self.manager.pool.num_free - before
        return freed

    def reclaim_slot(self) -> bool:
        """Free one cache slot: demote the least recently used idle chain, or drop an idle prefix holder."""
        idle = sorted(self._idle(), key=lambda c: c.last_used)
        if idle:
            self.demote(idle[0])
            return True
        return self.prefixes.drop_idle() > 0

    def restore_pages(self, seq: Sequence, n_new: int = 0, allow_idle: bool = False) -> int:
        """Pages restoring the chain's host copy and appending ``n_new`` tokens would take (0 if
        there is nothing to restore)."""
        chain = self.chains.get(seq.seq_id)
        if chain is None or chain.host is None or chain.host.kv is None or self.manager.has(seq.seq_id):
            return 0
        if chain.state is not ChainState.ACTIVE and not allow_idle:
            return 0
        return int(ceil_div(chain.host.kv.lengths.long() + n_new, self.manager.page_size).sum())

    def restore(self, seq: Sequence) -> None:
        """Bring a chain's host copy back onto the GPU (called by the scheduler at admission)."""
        chain = self.chains[seq.seq_id]
        snap = chain.host
        self.manager.restore(seq.seq_id, snap.kv)
        self.controller.admit(SeqInfo(seq.seq_id, snap.meta["num_cached"], seq.protected_len), chain.spec)
        state = dict(snap.meta.get("method_state", {}))
        state.update({k[len("method.") :]: v for k, v in snap.tensors.items() if k.startswith("method.")})
        if state:
            self.controller.load_state_dict(seq.seq_id, state)
        if "queries" in snap.tensors and chain.queries is not None:
            chain.queries.q = snap.tensors["queries"].to(self.manager.device)
            chain.queries.count = list(snap.meta.get("query_count", []))
        seq.num_cached = snap.meta["num_cached"]
        self.clear_host(chain)

    def swap_out(self, seq: Sequence) -> bool:
        """A running session is preempted: its KV and method state go to host memory (the scheduler
        readmits it through ``restore``, and it goes on where it stopped). False when ``seq`` is no
        session's or host memory has no room for it (the caller then drops its KV)."""
        chain = self.chains.get(seq.seq_id)
        if chain is None or not self.manager.has(seq.seq_id):
            return False
        snap = self.snapshot_kv(chain)
        if self.host_bytes + snap.nbytes > self.host_limit and not self._make_host_room(snap.nbytes, keep=chain):
            return False
        self.release_gpu(chain)
        self.set_host(chain, snap, Tier.HOST)
        chain.state = ChainState.ACTIVE  # still running its turn, with its KV in host memory
        self.swaps += 1
        return True

    def preempted(self, seq: Sequence) -> None:
        """A running session lost its cache to preemption: it will re-prefill its history."""
        chain = self.chains.get(seq.seq_id)
        if chain is not None:
            self.prefixes.detach(chain.prefix_holder)
            chain.prefix_holder = None

    # --- moves ------------------------------------------------------------------------------------
    def _idle(self) -> list[Chain]:
        return [c for c in self.chains.values() if c.state is ChainState.IDLE and self.manager.has(c.session_id)]

    def set_host(self, chain: Chain, snap: SessionSnapshot, source: Tier) -> None:
        self.clear_host(chain)
        chain.host, chain.host_source, chain.state = snap, source, ChainState.HOST
        self.host_bytes += snap.nbytes

    def clear_host(self, chain: Chain) -> None:
        if chain.host is not None:
            self.host_bytes -= chain.host.nbytes
            chain.host = None

    def demote(self, chain: Chain) -> None:
        """IDLE on the GPU -> host RAM (or to the history alone when host RAM is full)."""
        snap = self.snapshot_kv(chain)
        self.release_gpu(chain)
        self.set_host(chain, snap, Tier.HOST)
        self.demotions += 1
        self._make_host_room(0)

    def drop_to_history(self, chain: Chain) -> None:
        self.clear_host(chain)
        if self.manager.has(chain.session_id):
            self.release_gpu(chain)
        chain.seq.num_cached = 0
        chain.state = ChainState.HISTORY

    def release_gpu(self, chain: Chain) -> None:
        self.manager.release(chain.session_id)
        self.controller.release(chain.session_id)
        self.prefixes.detach(chain.prefix_holder)
        chain.prefix_holder = None

    def snapshot_kv(self, chain: Chain) -> SessionSnapshot:
        """The chain's KV, method state and query window as a host snapshot (its meta: KV_STATE_KEYS)."""
        sid = chain.session_id
        state = self.controller.state_dict(sid)
        tensors = {f"method.{k}": v for k, v in state.items() if isinstance(v, torch.Tensor)}
        plain = {k: v for k, v in state.items() if not isinstance(v, torch.Tensor)}
        if chain.queries is not None and chain.queries.q is not None:
            tensors["queries"] = chain.queries.q.to("cpu", copy=True)  # never the live window itself
        meta = {
            "method_state": plain,
            "num_cached": chain.seq.num_cached,
            "query_count": chain.queries.count if chain.queries else [],
        }
        return SessionSnapshot(meta=meta, kv=self.manager.snapshot(sid), tensors=tensors)

    def _make_host_room(self, nbytes: int, keep: Chain | None = None) -> bool:
        """Drop idle sessions' host copies (least recently used first, ``keep`` spared) to their
        history until ``nbytes`` more fit in ``host_cache_gb``."""
        victims = sorted(
            (c for c in self.chains.values() if c.state is ChainState.HOST and c is not keep), key=lambda c: c.last_used
        )
        for c in victims:
            if self.host_bytes + nbytes <= self.host_limit:
                break
            self.drop_to_history(c)
        return self.host_bytes + nbytes <= self.host_limit

    def ensure_on_gpu(self, chain: Chain) -> None:
        """Bring a chain in host RAM back to the GPU between turns (pruning works on resident KV)."""
        if chain.state is not ChainState.HOST:
            return
        need = self.restore_pages(chain.seq, allow_idle=True)
        if need > self.manager.pool.num_free:
            self.reclaim(need - self.manager.pool.num_free)
        if (self.manager.num_free_slots == 0 and not self.reclaim_slot()) or need > self.manager.pool.num_free:
            raise SessionError(f"session {chain.session_id!r} is in host RAM and the GPU pool has no room for it now")
        self.restore(chain.seq)
        chain.state = ChainState.IDLE
