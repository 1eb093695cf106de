"""Tier moves of session chains: GPU pages <-> host RAM <-> the history alone.

``ChainTiers`` is what the Scheduler reclaims through (its ``Reclaimer`` protocol): it demotes
idle chains (lowest eviction priority first, then lowest agent-hint priority, then least recently
used; a pinned one not while its pin holds) to host RAM when the pool or the cache slots run short,
swaps a preempted running session's KV out to host memory, and restores a chain's host copy when
its sequence is admitted again. Past ``host_cache_gb`` host copies are dropped in the same order
to the token history alone (the next turn re-prefills it). A chain in host memory whose agent said
when it would be back (the ``expected_return_s`` hint) is prefetched onto the GPU shortly before
then, into pages no admitted or waiting turn needs (``prefetch``). It also measures what the GPU
tier holds of each span of a chain's history (``span_kv_tokens``, for cache inspection).
"""

from __future__ import annotations

import time
from typing import Hashable

import torch

from engine.cache.manager import CacheManager
from engine.cache.snapshot import SessionSnapshot
from engine.cache.transfer import ceil_div
from engine.chain.errors import PinLimit, SessionError, SessionNotFound
from engine.chain.hints import SessionHints
from engine.chain.records import Chain, ChainState, Tier
from engine.controller import SparseController
from engine.lifecycle import SeqInfo
from engine.method_spec import MethodSpec
from engine.prefix import PrefixIndex
from engine.sequence import Sequence


def demotion_order(chain: Chain) -> tuple[int, int, float]:
    """Which idle chain leaves a tier first: the lowest ``eviction_priority`` (cache control), then
    the lowest agent-hint ``priority``, then the least recently used."""
    return chain.eviction_priority, chain.priority, chain.last_used


class ChainTiers:
    def __init__(
        self,
        chains: dict[Hashable, Chain],
        manager: CacheManager,
        controller: SparseController,
        prefixes: PrefixIndex,
        host_limit: int,
        *,
        max_pin_ttl_s: float = 0.0,
        max_pinned_fraction: float = 0.0,
        prefetch_lead_s: float = 0.0,
    ):
        self.chains = chains
        """The session chains (shared with the ChainCache that owns them)."""
        self.manager = manager
        self.controller = controller
        self.prefixes = prefixes
        self.host_limit = host_limit
        self.max_pin_ttl_s = max_pin_ttl_s
        self.max_pinned_fraction = max_pinned_fraction
        self.prefetch_lead_s = prefetch_lead_s
        """A chain is prefetched from this many seconds before its agent's expected return."""
        self.clock = time.monotonic
        """What pins expire and prefetches fall due by (a test may set another)."""
        self.host_bytes = 0
        self.demotions = 0
        self.swaps = 0
        self.prefetches = 0
        """Chains brought back from host memory ahead of their next turn."""
        self.prefetch_hits = 0
        """... whose next turn found them still on the GPU."""

    # --- the scheduler's side (Reclaimer) ---------------------------------------------------------
    def reclaim(self, pages: int) -> int:
        """Free at least ``pages`` pages if idle state allows: idle prefix holders, then idle chains
        (``demotion_order``) demoted to host RAM. Returns the pages freed."""
        freed = 0
        while freed < pages:
            n = self.prefixes.drop_idle()
            if n == 0:
                break
            freed += n
        for chain in sorted(self._idle(), key=demotion_order):
            if freed >= pages:
                break
            before = self.manager.pool.num_free
            self.demote(chain)
            freed += self.manager.pool.num_free - before
        return freed

    def reclaim_slot(self) -> bool:
        """Free one cache slot: demote the first idle chain in ``demotion_order``, or drop an idle prefix holder."""
        idle = sorted(self._idle(), key=demotion_order)
        if idle:
            self.demote(idle[0])
            return True
        return self.prefixes.drop_idle() > 0

    def swapped(self, seq: Sequence) -> bool:
        """Is the running turn's chain in host memory (restored when its sequence is admitted)?"""
        chain = self.chains.get(seq.seq_id)
        return (
            chain is not None
            and chain.state is ChainState.ACTIVE
            and chain.host is not None
            and chain.host.kv is not None
            and not self.manager.has(seq.seq_id)
        )

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

    # --- priorities and residency ----------------------------------------------------------------
    def _chain(self, session_id: Hashable) -> Chain:
        chain = self.chains.get(session_id)
        if chain is None:
            raise SessionNotFound(f"no session {session_id!r}")
        return chain

    def set_priority(self, session_id: Hashable, priority: int) -> None:
        """The chain's place in ``demotion_order``: a lower priority leaves a tier first."""
        self._chain(session_id).eviction_priority = int(priority)

    def span_kv_tokens(self, session_id: Hashable) -> list[float] | None:
        """Per tagged span of the session's history, the KV entries the GPU holds for it, averaged
        over layers and kv-heads (a span a method or a pruning shrank holds fewer than its length);
        None when the session's KV is not on the GPU."""
        chain = self._chain(session_id)
        if not self.manager.has(session_id):
            return None
        pos = self.manager.positions(session_id)
        per_position = torch.bincount(pos[pos >= 0].long().flatten(), minlength=len(chain.history) + 1)
        upto = [0] + per_position.cumsum(0).tolist()
        heads = pos.shape[0] * pos.shape[1]
        return [(upto[s.end] - upto[s.start]) / heads for s in chain.spans]

    # --- agent hints (engine/chain/hints.py) ------------------------------------------------------
    def check_hints(self, session_id: Hashable, spec: MethodSpec, total_tokens: int, hints: SessionHints) -> None:
        """Raise InvalidHint for a hint out of range, PinLimit for a pin that would take the pinned
        sessions past ``max_pinned_fraction`` of the pool (counting the most this session can hold
        after the turn: ``total_tokens`` under its method's budget)."""
        hints.check(self.max_pin_ttl_s)
        if hints.pin_ttl_s is None:
            return
        limit = int(self.max_pinned_fraction * self.manager.pool.num_pages)
        kept = min(total_tokens, self.controller.method_for(spec).kept_tokens(total_tokens))
        need = self.manager.pages_for_new(kept)
        held = self.pinned_pages(exclude=session_id)
        if held + need > limit:
            raise PinLimit(
                f"pinning session {session_id!r} (up to {need} KV pages) would take the pinned sessions to "
                f"{held + need} pages; at most {limit} ({self.max_pinned_fraction:g} of the pool) may be pinned"
            )

    def turn_started(self, chain: Chain) -> None:
        """A turn starts on the chain: the return its last turn announced has come (a prefetch that
        brought it back is a hit when it is still on the GPU)."""
        if chain.prefetched and chain.state is ChainState.IDLE:
            self.prefetch_hits += 1
        chain.expected_at, chain.prefetched = None, False

    def after_turn(self, chain: Chain, hints: SessionHints | None) -> None:
        """A turn ended normally: its pin starts (its TTL from now), or a release ends any pin and
        demotes the idle chain to host memory; an expected return is noted for ``prefetch``."""
        if hints is None:
            return
        if hints.expected_return_s is not None:
            chain.expected_at = self.clock() + hints.expected_return_s
        if hints.release:
            chain.pinned_until = 0.0
            if chain.state is ChainState.IDLE and self.manager.has(chain.session_id):
                self.demote(chain)
        elif hints.pin_ttl_s is not None:
            chain.pinned_until = self.clock() + hints.pin_ttl_s

    # --- prefetch (the expected_return_s hint) ------------------------------------------------------
    def _expected(self) -> list[Chain]:
        """Chains in host memory whose agent said when it would be back, the earliest expected first."""
        waiting = [c for c in self.chains.values() if c.state is ChainState.HOST and c.expected_at is not None]
        return sorted(waiting, key=lambda c: c.expected_at)

    def prefetch_due(self) -> bool:
        """Is a chain in host memory within ``prefetch_lead_s`` of its expected return (or past it)?"""
        now = self.clock()
        return any(c.expected_at - self.prefetch_lead_s <= now for c in self._expected())

    def next_prefetch_in(self, now: float | None = None) -> float | None:
        """Seconds from ``now`` (default: ``clock()``) until the next chain in host memory falls due
        for a prefetch (None: none will; chains already due are not counted: pages freeing up is
        what they wait for)."""
        now = self.clock() if now is None else now
        ahead = [c.expected_at - self.prefetch_lead_s - now for c in self._expected()]
        ahead = [t for t in ahead if t > 0]
        return min(ahead) if ahead else None

    def prefetch(self, pages: int, slots: int, limit: int | None = None) -> int:
        """Bring chains in host memory that are due (the earliest expected first) back onto the GPU
        while they fit in ``pages`` spare pages and ``slots`` spare cache slots, at most ``limit``
        of them; nothing is demoted or reclaimed to make room. A chain that does not fit waits while
        smaller ones after it are brought back. Each is prefetched once per announced return; it
        keeps its place in ``demotion_order``, so work that needs the pages again takes them back
        first. Returns the chains prefetched."""
        now = self.clock()
        done = 0
        for chain in self._expected():
            if (limit is not None and done >= limit) or slots <= 0:
                break
            if chain.expected_at - self.prefetch_lead_s > now:
                break  # the rest are expected later still
            need = self.restore_pages(chain.seq, allow_idle=True)
            if need <= 0 or need > pages or need > self.manager.pool.num_free:
                continue  # nothing to copy back, or no room for it now
            self.restore(chain.seq)
            chain.state = ChainState.IDLE
            chain.expected_at, chain.prefetched = None, True
            pages, slots, done = pages - need, slots - 1, done + 1
            self.prefetches += 1
        return done

    # --- moves ------------------------------------------------------------------------------------
    def _idle(self) -> list[Chain]:
        """Idle chains on the GPU that may be demoted, in demotion order: lowest priority, then least
        recently used. A pinned chain (agent hints) is not among them while its pin holds."""
        now = self.clock()
        idle = [
            c
            for c in self.chains.values()
            if c.state is ChainState.IDLE and not c.pinned(now) and self.manager.has(c.session_id)
        ]
        return sorted(idle, key=lambda c: (c.priority, c.last_used))

    def pinned_pages(self, exclude: Hashable = None) -> int:
        """Pages the chains with a live pin hold on the GPU (``exclude``: one session left out)."""
        now = self.clock()
        return sum(
            self.manager.num_pages(c.session_id)
            for c in self.chains.values()
            if c.session_id != exclude and c.pinned(now) and self.manager.has(c.session_id)
        )

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
        """Drop idle sessions' host copies (in ``demotion_order``, ``keep`` spared) to their history
        until ``nbytes`` more fit in ``host_cache_gb``."""
        victims = sorted(
            (c for c in self.chains.values() if c.state is ChainState.HOST and c is not keep), key=demotion_order
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
