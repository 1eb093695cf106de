"""The Chain Cache: an agent session's KV survives between turns, so a turn prefills only what is new.

A *chain* is the engine-side state of one session (engine/chain/records.py): the logical token
history (every token ever seen, append-only), the physical KV per head (possibly compressed by the
session's method), the method's state, ``turn_index``, ``generation`` and a SHA-256 digest of the
history.

Tiers. A chain is ACTIVE while a turn runs, then IDLE with its pages on the GPU. Under page
pressure IDLE chains are demoted in LRU order to host RAM (a snapshot of their KV and method
state) and, past ``host_cache_gb``, dropped to their token history alone (the sidecar keeps a copy
in its store). The next turn brings a chain back: from the GPU, host RAM, a loaded store
snapshot, or, when nothing else is left, by re-prefilling the history (RECOMPUTE). Every turn
reports which tier its session came from; nothing is lost silently. The moves are ChainTiers'
(engine/chain/tiers.py), which is also what the Scheduler reclaims through.

ChainCache is given its collaborators (the cache manager, the sparse controller, the request
factory that validates and builds Sequences) and never calls back into the engine: the engine
drives it (start a turn, end a turn, end a session once its turn is aborted).
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Hashable

from engine.cache.manager import CacheManager
from engine.cache.snapshot import SessionSnapshot
from engine.chain.codec import decode_record, encode_record
from engine.chain.errors import (
    ContextFull,
    HistoryMismatch,
    SessionBusy,
    SessionError,
    SessionExists,
    SessionNotFound,
    TurnIndexMismatch,
)
from engine.chain.info import SessionInfo, SpanInfo
from engine.chain.records import Chain, ChainState, PruneRecord, TaggedSpan, Tier
from engine.chain.tiers import ChainTiers
from engine.chain.turn_spec import TurnSpec
from engine.config import EngineConfig
from engine.controller import SparseController
from engine.lifecycle import SeqInfo
from engine.method_spec import MethodSpec
from engine.prefix import PrefixIndex, QueryWindow, prune_span
from engine.prune_rule import check_policy, check_span, due_spans
from engine.requests import RequestFactory
from engine.sampling import SamplingParams
from engine.sequence import Sequence


class ChainCache:
    """Session chains of one engine: turns, tiers, forks, pruning, snapshots."""

    def __init__(
        self,
        config: EngineConfig,
        manager: CacheManager,
        controller: SparseController,
        requests: RequestFactory,
        default_spec: MethodSpec,
        fingerprint: str,
    ):
        """``fingerprint``: what the KV computed here depends on (a snapshot from another one is
        recomputed); it also salts the shared-prefix hashes."""
        self.config = config
        self.manager = manager
        self.controller = controller
        self.requests = requests
        self.default_spec = default_spec
        self.fingerprint = fingerprint
        self.max_model_len = requests.max_model_len
        self.chains: dict[Hashable, Chain] = {}
        self.prefixes = PrefixIndex(manager, fingerprint.encode())
        self.tiers = ChainTiers(
            self.chains,
            manager,
            controller,
            self.prefixes,
            int(config.host_cache_gb * 2**30),
            max_pin_ttl_s=config.max_pin_ttl_s,
            max_pinned_fraction=config.max_pinned_fraction,
            prefetch_lead_s=config.prefetch_lead_s,
        )
        """The tier moves; what the Scheduler reclaims through."""

    @property
    def demotions(self) -> int:
        return self.tiers.demotions

    @property
    def swaps(self) -> int:
        return self.tiers.swaps

    @property
    def host_bytes(self) -> int:
        return self.tiers.host_bytes

    # --- turns -----------------------------------------------------------------------------------
    def start_turn(self, session_id: Hashable, turn: TurnSpec) -> Sequence:
        """The Sequence that runs ``turn`` on the session (created by its first turn); checked
        before anything changes."""
        tokens, params, method, hints = list(turn.tokens), turn.params, turn.method, turn.hints
        expected_turn_index, history = turn.expected_turn_index, turn.history
        chain = self.chains.get(session_id)
        if chain is not None and chain.state is ChainState.ACTIVE:
            raise SessionBusy(f"a turn is already running on session {session_id!r}")
        if expected_turn_index is not None and expected_turn_index != (chain.turn_index if chain else 0):
            have = chain.turn_index if chain else 0
            raise TurnIndexMismatch(
                f"session {session_id!r} is at turn {have}, not {expected_turn_index}", have, expected_turn_index
            )
        old = chain.history if chain else []
        if history is not None:
            if list(history[: len(old)]) != old:
                raise HistoryMismatch(
                    f"the history given does not extend session {session_id!r}'s "
                    f"{len(old)}-token history; start a new session or fork"
                )
            tokens = list(history[len(old) :])
        if not tokens:
            raise HistoryMismatch("a turn must add at least one token")
        if len(old) + len(tokens) >= self.max_model_len:
            raise ContextFull(
                f"session {session_id!r} would reach {len(old) + len(tokens)} tokens; "
                f"max_model_len is {self.max_model_len}"
            )
        if hints is not None:  # a bad hint or a pin the pool cannot grant fails before anything changes
            total = len(old) + len(tokens) + params.max_tokens
            self.tiers.check_hints(session_id, chain.spec if chain else (method or self.default_spec), total, hints)
        if chain is None:
            spec = method or self.default_spec
            self.controller.method_for(spec)  # a bad spec fails before anything changes
            seq = self.requests.new_sequence(session_id, tokens, params, spec)
            chain = Chain(session_id=session_id, seq=seq, spec=spec, queries=self._query_window(spec))
            self._attach_prefix(chain, tokens, turn.shared_prefix, turn.prefix_scope)
            seq.source_tier = Tier.NEW
            self.chains[session_id] = chain
        else:
            if method is not None and method.key() != chain.spec.key():
                raise SessionError(
                    f"session {session_id!r} uses method {chain.spec.method!r}; it cannot change mid-session"
                )
            seq = chain.seq
            self.requests.restart_sequence(seq, tokens, params)
            seq.source_tier = self._source_tier(chain)
            if chain.state is ChainState.HISTORY:
                seq.num_cached = 0
            reused = chain.host.meta["num_cached"] if chain.state is ChainState.HOST else seq.num_cached
            seq.counters.reused_tokens = reused
            self.tiers.turn_started(chain)
        start = len(seq.token_ids) - len(tokens)
        for a, b, r in turn.spans or [(0, len(tokens), turn.role)]:
            if not (0 <= a < b <= len(tokens)):
                raise SessionError(f"span ({a}, {b}) lies outside the turn's {len(tokens)} tokens")
            chain.spans.append(TaggedSpan(start + a, start + b, r, turn=chain.turn_index))
        chain.state = ChainState.ACTIVE
        chain.last_used = time.monotonic()
        chain.hints = hints
        if hints is not None and hints.priority is not None:
            chain.priority = hints.priority
        seq.priority = chain.priority
        return seq

    def _source_tier(self, chain: Chain) -> Tier:
        if chain.state is ChainState.IDLE:
            return Tier.GPU
        if chain.state is ChainState.HOST:
            return chain.host_source
        return Tier.RECOMPUTE

    def _attach_prefix(self, chain: Chain, tokens: list[int], shared_prefix: int, scope: str = "") -> None:
        """Fork the longest cached copy of the session's shared prefix; protect the prefix."""
        if not self.config.prefix_sharing or shared_prefix <= 0:
            return
        seq, P = chain.seq, self.manager.page_size
        full = min(shared_prefix, len(tokens) - 1) // P
        if full == 0:
            return
        holder, n, hashes = self.prefixes.match(tokens[: full * P], scope)
        seq.protected_len = full * P
        if holder is not None and (self.manager.num_free_slots > 0 or self.tiers.reclaim_slot()):
            self.prefixes.attach(holder, seq.seq_id, n)
            chain.prefix_holder = holder.holder_id
            seq.num_cached = n * P
            seq.counters.reused_tokens = n * P
            self.controller.admit(SeqInfo(seq.seq_id, seq.num_cached, seq.protected_len), chain.spec)
        else:
            n = 0
        if n < full:  # this session prefills the rest of the prefix and leaves a holder behind
            chain.prefix_hashes = hashes
            seq.prefix_boundary = full * P

    def after_step(self, seq: Sequence) -> None:
        """Called after every forward pass a session took part in (prefix holders are made here)."""
        if seq.prefix_boundary and seq.num_cached >= seq.prefix_boundary:
            chain = self.chains[seq.seq_id]
            holder = self.prefixes.register(seq.seq_id, chain.prefix_hashes)
            if holder is not None:
                chain.prefix_holder = holder.holder_id
            seq.prefix_boundary, chain.prefix_hashes = 0, []

    def finish_turn(self, seq: Sequence) -> None:
        """The turn ended normally: the chain stays, IDLE on the GPU, and may compress and prune."""
        chain = self.chains[seq.seq_id]
        out_start = seq.prompt_len
        if len(seq.token_ids) > out_start:
            chain.spans.append(TaggedSpan(out_start, len(seq.token_ids), "assistant", turn=chain.turn_index))
        chain.last_used = time.monotonic()
        if not self.manager.has(seq.seq_id):
            chain.state = ChainState.HISTORY
            chain.turn_index += 1
            chain.generation += 1
            self.tiers.after_turn(chain, chain.hints)
            return
        chain.state = ChainState.IDLE
        turn_spans = [s for s in chain.spans if s.turn == chain.turn_index]
        self.controller.on_turn_end(SeqInfo(seq.seq_id, seq.num_cached, seq.protected_len), turn_spans)
        if seq.source_tier is Tier.RECOMPUTE:  # the rebuilt KV gets the prunings the log records
            for entry in list(chain.prune_log):
                prune_span(
                    self.manager,
                    seq.seq_id,
                    entry.start,
                    entry.end,
                    entry.policy,
                    entry.keep_ratio,
                    entry.scope,
                    chain.queries,
                    seq.protected_len,
                )
        self._auto_prune(chain)
        chain.turn_index += 1
        chain.generation += 1
        self.tiers.after_turn(chain, chain.hints)

    def abort_turn(self, seq: Sequence) -> None:
        """An aborted turn is rolled back: its tokens leave the history and their KV is evicted.
        (Compression a method did to older tokens during the turn stays.)"""
        chain = self.chains[seq.seq_id]
        start = seq.turn_start
        del seq.token_ids[start:]
        seq.prompt_len = start
        chain.spans = [s for s in chain.spans if s.start < start]
        chain.reset_digest()
        if self.manager.has(seq.seq_id):
            pos = self.manager.positions(seq.seq_id)
            self.manager.compact_seq(seq.seq_id, (pos >= 0) & (pos < start))
            seq.num_cached = min(seq.num_cached, start)
            chain.state = ChainState.IDLE
        elif chain.host is not None:
            chain.state = ChainState.HOST
        else:
            seq.num_cached = 0
            chain.state = ChainState.HISTORY

    def fail_turn(self, seq: Sequence) -> None:
        """The pool could not hold the turn: roll it back and keep the history only."""
        chain = self.chains[seq.seq_id]
        if self.manager.has(seq.seq_id):
            self.tiers.release_gpu(chain)
        self.tiers.clear_host(chain)
        self.abort_turn(seq)

    # --- pruning ------------------------------------------------------------------------------------
    def _auto_prune(self, chain: Chain) -> None:
        cfg = self.config
        if cfg.prune_lag is None and cfg.prune_trigger_tokens is None:
            return
        for start, end, reason in due_spans(
            chain.spans, chain.turn_index, cfg.prune_roles, lag=cfg.prune_lag, trigger_tokens=cfg.prune_trigger_tokens
        ):
            self.prune(chain.session_id, start, end, reason=reason)

    def prune(
        self,
        session_id: Hashable,
        start: int,
        end: int,
        policy: str | None = None,
        keep_ratio: float | None = None,
        scope: str | None = None,
        reason: str = "request",
    ) -> int:
        """Shrink the physical KV of history positions [start, end); the history stays. Returns
        the KV tokens removed, summed over layers and kv-heads."""
        chain = self._get(session_id)
        if chain.state is ChainState.ACTIVE:
            raise SessionBusy(f"session {session_id!r} is running a turn")
        cfg = self.config
        policy, scope = policy or cfg.prune_policy, scope or cfg.prune_scope
        keep_ratio = cfg.prune_keep_ratio if keep_ratio is None else keep_ratio
        check_policy(policy, keep_ratio, scope)
        check_span(start, end, len(chain.history))
        self.tiers.ensure_on_gpu(chain)
        removed = 0
        if chain.state is ChainState.IDLE:
            removed = prune_span(
                self.manager, session_id, start, end, policy, keep_ratio, scope, chain.queries, chain.seq.protected_len
            )
        for s in chain.spans:
            if s.start >= start and s.end <= end:
                s.pruned = True
        chain.prune_log.append(PruneRecord(chain.turn_index, start, end, policy, keep_ratio, scope, reason, removed))
        chain.pruned_tokens += removed
        chain.generation += 1
        return removed

    # --- sessions --------------------------------------------------------------------------------
    def _get(self, session_id: Hashable) -> Chain:
        chain = self.chains.get(session_id)
        if chain is None:
            raise SessionNotFound(f"no session {session_id!r}")
        return chain

    def fork(self, parent_id: Hashable, child_id: Hashable) -> None:
        parent = self._get(parent_id)
        if child_id in self.chains:
            raise SessionExists(f"session {child_id!r} already exists")
        if parent.state is ChainState.ACTIVE:
            raise SessionBusy(f"session {parent_id!r} is running a turn; fork it between turns")
        seq = self.requests.new_sequence(child_id, list(parent.history), parent.seq.params, parent.spec)
        seq.num_cached = parent.seq.num_cached
        seq.protected_len = parent.seq.protected_len
        seq.finish_idle()
        child = Chain(
            session_id=child_id,
            seq=seq,
            spec=parent.spec,
            turn_index=parent.turn_index,
            spans=[TaggedSpan(**vars(s)) for s in parent.spans],
            prune_log=list(parent.prune_log),
            pruned_tokens=parent.pruned_tokens,
        )
        if parent.queries is not None:
            child.queries = QueryWindow(
                parent.queries.size,
                parent.queries.num_layers,
                None if parent.queries.q is None else parent.queries.q.clone(),
                list(parent.queries.count),
                parent.queries.decode,
            )
        if parent.state is ChainState.IDLE:
            if self.manager.num_free_slots == 0 and not self.tiers.reclaim_slot():
                raise SessionError("no cache slot is free for the fork")
            self.manager.fork(parent_id, child_id)
            self.controller.fork(parent_id, child_id)
            child.state = ChainState.IDLE
        elif parent.state is ChainState.HOST:
            self.tiers.set_host(child, parent.host, parent.host_source)  # shared read-only, counted twice
        else:
            child.state = ChainState.HISTORY
        self.chains[child_id] = child

    def end(self, session_id: Hashable) -> None:
        """Drop a session between turns (the engine aborts a running turn first)."""
        chain = self._get(session_id)
        if chain.state is ChainState.ACTIVE:
            raise SessionBusy(f"session {session_id!r} is running a turn; abort it before ending the session")
        if self.manager.has(session_id):
            self.tiers.release_gpu(chain)
        self.tiers.clear_host(chain)
        del self.chains[session_id]

    def info(self, session_id: Hashable) -> SessionInfo:
        chain = self._get(session_id)
        mgr = self.manager
        on_gpu = mgr.has(session_id)
        return SessionInfo(
            session_id=session_id,
            state=chain.state.value,
            turn_index=chain.turn_index,
            generation=chain.generation,
            num_tokens=len(chain.history),
            cached_tokens=chain.seq.num_cached,
            digest=chain.digest,
            spec=chain.spec.copy(),
            kv_tokens=int(mgr.seq_lengths(session_id).sum()) if on_gpu else 0,
            kv_pages=mgr.num_pages(session_id) if on_gpu else 0,
            cold_tokens=self.controller.recall.cold_tokens(session_id) if on_gpu else 0,
            recall=replace(self.controller.recall.turn_report(session_id)),  # a copy: the last turn's copies
            pruned_tokens=chain.pruned_tokens,
            prune_log=tuple(chain.prune_log),
            shared_prefix_tokens=chain.seq.protected_len,
            spans=tuple(SpanInfo(s.start, s.end, s.role, s.turn, s.pruned) for s in chain.spans),
            last_token=chain.history[-1] if chain.history else None,
        )

    # --- snapshots for the session store ------------------------------------------------------------
    def snapshot(self, session_id: Hashable, with_kv: bool = True) -> SessionSnapshot:
        """The whole session (history, metadata, KV and method state) for a store; between turns."""
        chain = self._get(session_id)
        if chain.state is ChainState.ACTIVE:
            raise SessionBusy(f"session {session_id!r} is running a turn")
        if with_kv and chain.state is ChainState.IDLE:
            snap = self.tiers.snapshot_kv(chain)
        elif with_kv and chain.state is ChainState.HOST:
            snap = SessionSnapshot(meta=dict(chain.host.meta), kv=chain.host.kv, tensors=dict(chain.host.tensors))
        else:
            snap = SessionSnapshot(meta={"num_cached": 0}, kv=None)
        return encode_record(snap, chain, self.fingerprint)

    def load(self, snap: SessionSnapshot, source: Tier = Tier.STORE) -> None:
        """Make a session from a store snapshot; its KV comes onto the GPU on the next turn. A
        snapshot whose KV is missing or was made by another model/setup is rebuilt (RECOMPUTE)."""
        sid = snap.meta["session_id"]
        if sid in self.chains:
            raise SessionExists(f"session {sid!r} already exists on this engine")
        rec = decode_record(snap)
        self.controller.method_for(rec.spec)
        seq = self.requests.new_sequence(sid, rec.tokens, SamplingParams(), rec.spec)
        seq.protected_len = rec.protected_len
        seq.finish_idle()
        chain = Chain(
            session_id=sid,
            seq=seq,
            spec=rec.spec,
            turn_index=rec.turn_index,
            generation=rec.generation,
            spans=rec.spans,
            prune_log=rec.prune_log,
            pruned_tokens=rec.pruned_tokens,
            queries=self._query_window(rec.spec),
        )
        if snap.kv is not None and rec.fingerprint == self.fingerprint:
            self.tiers.set_host(chain, snap, source)
            seq.num_cached = snap.meta["num_cached"]
        else:
            chain.state = ChainState.HISTORY
        self.chains[sid] = chain

    def _query_window(self, spec) -> QueryWindow | None:
        """The recent-query window a session keeps when pruning keeps the most attended tokens, or
        when its method recalls evicted KV (engine/recall.py)."""
        prune = self.config.prune_window if self.config.prune_policy == "keep_ratio" else 0
        recall = self.controller.method_for(spec).recall_settings()
        size = max(prune, recall.recall_window if recall is not None else 0)
        decode = bool(prune) or (recall is not None and recall.recall_interval is not None)
        return QueryWindow(size, self.manager.num_layers, decode=decode) if size else None
