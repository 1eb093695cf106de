"""The Chain Cache: an agent session's KV survives between turns, so a turn prefills only what is new.

A *chain* is the engine-side state of one session: the logical token history (every token ever
seen, append-only), the physical KV per head (possibly compressed by the session's method), the
method's state, ``turn_index``, ``generation`` and a SHA-256 digest of the history.

Tiers. A chain is ACTIVE while a turn runs, then IDLE with its pages on the GPU. Under page
pressure IDLE chains are demoted in LRU order to host RAM (a snapshot of their KV and method
state) and, past ``host_cache_gb``, dropped to their token history alone (the sidecar keeps a copy
in its store). The next turn brings a chain back: from the GPU, host RAM, a loaded store
snapshot, or, when nothing else is left, by re-prefilling the history (RECOMPUTE). Every turn
reports which tier its session came from; nothing is lost silently.
"""

from __future__ import annotations

import enum
import hashlib
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Hashable

import numpy as np
import torch

from engine.cache.manager import ceil_div
from engine.cache.snapshot import SessionSnapshot
from engine.lifecycle import MethodSpec, SeqInfo, Span
from engine.prefix import PrefixIndex, QueryWindow, prune_span
from engine.sampling import SamplingParams
from engine.sequence import Sequence, SeqStatus

if TYPE_CHECKING:  # pragma: no cover
    from engine.llm import LLMEngine


class Tier(str, enum.Enum):
    """Where a turn found its session."""

    NEW = "new"
    GPU = "gpu"
    HOST = "host"
    STORE = "store"
    RECOMPUTE = "recompute"


class ChainState(str, enum.Enum):
    ACTIVE = "active"
    IDLE = "idle"  # KV on the GPU
    HOST = "host"  # KV in host RAM
    HISTORY = "history"  # only the token history: the next turn re-prefills it


class SessionError(ValueError):
    """A session request that cannot be carried out as asked."""


class SessionNotFound(SessionError):
    pass


class SessionBusy(SessionError):
    """A turn is already running on the session."""


class HistoryMismatch(SessionError):
    """The tokens given do not extend the session's history."""


class TurnIndexMismatch(SessionError):
    """``expected_turn_index`` is not the session's turn index (optimistic concurrency)."""


class SessionExists(SessionError):
    """A session id that is already taken (fork target, loaded snapshot)."""


class ContextFull(SessionError):
    """The turn would make the session's history reach ``max_model_len``."""


KV_STATE_KEYS = ("method_state", "num_cached", "query_count")
"""Snapshot metadata that describes the KV itself and travels with it; the rest of a snapshot's
metadata is the session record (history, spans, method, ...), enough to rebuild the KV."""


@dataclass
class TaggedSpan(Span):
    turn: int = 0
    pruned: bool = False


@dataclass
class Chain:
    session_id: Hashable
    seq: Sequence
    spec: MethodSpec
    turn_index: int = 0
    generation: int = 0
    state: ChainState = ChainState.IDLE
    spans: list[TaggedSpan] = field(default_factory=list)
    prune_log: list[dict[str, Any]] = field(default_factory=list)
    host: SessionSnapshot | None = None
    """The KV and method state in host RAM (state HOST), or a loaded store snapshot."""
    host_source: Tier = Tier.HOST
    last_used: float = field(default_factory=time.monotonic)
    prefix_holder: tuple | None = None
    queries: QueryWindow | None = None
    pruned_tokens: int = 0
    _hash: Any = field(default_factory=hashlib.sha256)
    _hashed: int = 0

    def reset_digest(self) -> None:
        self._hash, self._hashed = hashlib.sha256(), 0

    @property
    def history(self) -> list[int]:
        return self.seq.token_ids

    @property
    def digest(self) -> str:
        h = self._hash
        if self._hashed < len(self.history):
            h.update(np.asarray(self.history[self._hashed :], dtype="<u4").tobytes())
            self._hashed = len(self.history)
        return h.hexdigest()


def history_digest(tokens: list[int]) -> str:
    return hashlib.sha256(np.asarray(tokens, dtype="<u4").tobytes()).hexdigest()


class ChainCache:
    """Session chains of one engine: turns, tiers, forks, pruning, snapshots."""

    def __init__(self, engine: "LLMEngine"):
        self.engine = engine
        cfg = engine.config
        self.manager = engine.manager
        self.controller = engine.controller
        self.chains: dict[Hashable, Chain] = {}
        self.host_bytes = 0
        self.host_limit = int(cfg.host_cache_gb * 2**30)
        self.prefixes = PrefixIndex(self.manager, engine.fingerprint().encode())
        self.demotions = 0
        self.swaps = 0

    # --- turns -----------------------------------------------------------------------------------
    def start_turn(self, session_id: Hashable, tokens: list[int], params: SamplingParams, *, role: str = "user",
                   spans: list[tuple[int, int, str]] | None = None, method: MethodSpec | None = None,
                   expected_turn_index: int | None = None, history: list[int] | None = None,
                   shared_prefix: int = 0, prefix_scope: str = "") -> Sequence:
        eng = self.engine
        chain = self.chains.get(session_id)
        if chain is not None and chain.state is ChainState.ACTIVE:
            raise SessionBusy(f"a turn is already running on session {session_id!r}")
        if expected_turn_index is not None and expected_turn_index != (chain.turn_index if chain else 0):
            raise TurnIndexMismatch(f"session {session_id!r} is at turn {chain.turn_index if chain else 0}, "
                                    f"not {expected_turn_index}")
        old = chain.history if chain else []
        if history is not None:
            if list(history[: len(old)]) != old:
                raise HistoryMismatch(f"the history given does not extend session {session_id!r}'s "
                                      f"{len(old)}-token history; start a new session or fork")
            tokens = list(history[len(old) :])
        if not tokens:
            raise HistoryMismatch("a turn must add at least one token")
        if len(old) + len(tokens) >= eng.max_model_len:
            raise ContextFull(f"session {session_id!r} would reach {len(old) + len(tokens)} tokens; "
                               f"max_model_len is {eng.max_model_len}")
        if chain is None:
            spec = method or eng.default_spec
            eng.controller.method_for(spec)  # a bad spec fails before anything changes
            seq = eng.new_sequence(session_id, tokens, params, spec)
            chain = Chain(session_id=session_id, seq=seq, spec=spec)
            if eng.config.prune_policy == "keep_ratio":
                chain.queries = QueryWindow(eng.config.prune_window, self.manager.num_layers)
            self._attach_prefix(chain, tokens, shared_prefix, prefix_scope)
            seq.source_tier = Tier.NEW
            self.chains[session_id] = chain
        else:
            if method is not None and method.key() != chain.spec.key():
                raise SessionError(f"session {session_id!r} uses method {chain.spec.method!r}; it cannot change mid-session")
            seq = chain.seq
            eng.restart_sequence(seq, tokens, params)
            seq.source_tier = self._source_tier(chain)
            if chain.state is ChainState.HISTORY:
                seq.num_cached = 0
            reused = chain.host.meta["num_cached"] if chain.state is ChainState.HOST else seq.num_cached
            seq.counters.reused_tokens = reused
        start = len(seq.token_ids) - len(tokens)
        for a, b, r in spans or [(0, len(tokens), role)]:
            if not (0 <= a < b <= len(tokens)):
                raise SessionError(f"span ({a}, {b}) lies outside the turn's {len(tokens)} tokens")
            chain.spans.append(TaggedSpan(start + a, start + b, r, turn=chain.turn_index))
        chain.state = ChainState.ACTIVE
        chain.last_used = time.monotonic()
        return seq

    def _source_tier(self, chain: Chain) -> Tier:
        if chain.state is ChainState.IDLE:
            return Tier.GPU
        if chain.state is ChainState.HOST:
            return chain.host_source
        return Tier.RECOMPUTE

    def _attach_prefix(self, chain: Chain, tokens: list[int], shared_prefix: int, scope: str = "") -> None:
        """Fork the longest cached copy of the session's shared prefix within ``scope``; protect the prefix."""
        if not self.engine.config.prefix_sharing or shared_prefix <= 0:
            return
        seq, P = chain.seq, self.manager.page_size
        full = min(shared_prefix, len(tokens) - 1) // P
        if full == 0:
            return
        holder, n, hashes = self.prefixes.match(tokens[: full * P], scope)
        seq.protected_len = full * P
        if holder is not None and (self.manager.num_free_slots > 0 or self.reclaim_slot()):
            self.prefixes.attach(holder, seq.seq_id, n)
            chain.prefix_holder = holder.holder_id
            seq.num_cached = n * P
            seq.counters.reused_tokens = n * P
            self.controller.admit(SeqInfo(seq.seq_id, seq.num_cached, seq.protected_len), chain.spec)
        else:
            n = 0
        if n < full:  # this session prefills the rest of the prefix and leaves a holder behind
            seq.prefix_hashes = hashes
            seq.prefix_boundary = full * P

    def after_step(self, seq: Sequence) -> None:
        """Called after every forward pass a session took part in (prefix holders are made here)."""
        if seq.prefix_boundary and seq.num_cached >= seq.prefix_boundary:
            holder = self.prefixes.register(seq.seq_id, seq.prefix_hashes)
            if holder is not None:
                self.chains[seq.seq_id].prefix_holder = holder.holder_id
            seq.prefix_boundary, seq.prefix_hashes = 0, []

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
            return
        chain.state = ChainState.IDLE
        turn_spans = [s for s in chain.spans if s.turn == chain.turn_index]
        self.controller.on_turn_end(SeqInfo(seq.seq_id, seq.num_cached, seq.protected_len), turn_spans)
        if seq.source_tier is Tier.RECOMPUTE:  # the rebuilt KV gets the prunings the log records
            for entry in list(chain.prune_log):
                prune_span(self.manager, seq.seq_id, entry["start"], entry["end"], entry["policy"], entry["keep_ratio"],
                           entry["scope"], chain.queries, seq.protected_len)
        self._auto_prune(chain)
        chain.turn_index += 1
        chain.generation += 1

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
            self._release_gpu(chain)
        self._clear_host(chain)
        self.abort_turn(seq)

    # --- pruning ------------------------------------------------------------------------------------
    def _auto_prune(self, chain: Chain) -> None:
        cfg = self.engine.config
        if cfg.prune_lag is None and cfg.prune_trigger_tokens is None:
            return
        for span in chain.spans:
            if span.pruned or span.role not in cfg.prune_roles:
                continue
            old = cfg.prune_lag is not None and chain.turn_index - span.turn >= cfg.prune_lag
            big = cfg.prune_trigger_tokens is not None and span.end - span.start > cfg.prune_trigger_tokens
            if old or big:
                self.prune(chain.session_id, span.start, span.end, reason="lag" if old else "trigger")

    def prune(self, session_id: Hashable, start: int, end: int, policy: str | None = None,
              keep_ratio: float | None = None, scope: str | None = None, reason: str = "request") -> int:
        """Shrink the physical KV of history positions [start, end); the history stays. Returns
        the KV tokens removed, summed over layers and kv-heads."""
        chain = self._get(session_id)
        if chain.state is ChainState.ACTIVE:
            raise SessionBusy(f"session {session_id!r} is running a turn")
        cfg = self.engine.config
        policy, scope = policy or cfg.prune_policy, scope or cfg.prune_scope
        keep_ratio = cfg.prune_keep_ratio if keep_ratio is None else keep_ratio
        if policy not in ("drop", "keep_ratio") or scope not in ("global", "per_head") or not 0 <= keep_ratio <= 1:
            raise SessionError(f"bad pruning policy {policy!r}/{scope!r}/{keep_ratio}")
        if not 0 <= start < end <= len(chain.history):
            raise SessionError(f"span ({start}, {end}) lies outside the {len(chain.history)}-token history")
        self._ensure_on_gpu(chain)
        removed = 0
        if chain.state is ChainState.IDLE:
            removed = prune_span(self.manager, session_id, start, end, policy, keep_ratio, scope, chain.queries,
                                 chain.seq.protected_len)
        for s in chain.spans:
            if s.start >= start and s.end <= end:
                s.pruned = True
        chain.prune_log.append({"turn": chain.turn_index, "start": start, "end": end, "policy": policy,
                                "keep_ratio": keep_ratio, "scope": scope, "reason": reason, "removed": removed})
        chain.pruned_tokens += removed
        chain.generation += 1
        return removed

    # --- tiers ------------------------------------------------------------------------------------
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
            self._demote(chain)
            freed += self.manager.pool.num_free - before
        return freed

    def reclaim_slot(self) -> bool:
        idle = sorted(self._idle(), key=lambda c: c.last_used)
        if idle:
            self._demote(idle[0])
            return True
        return self.prefixes.drop_idle() > 0

    def _idle(self) -> list[Chain]:
        return [c for c in self.chains.values() if c.state is ChainState.IDLE and self.manager.has(c.session_id)]

    def _set_host(self, chain: Chain, snap: SessionSnapshot, source: Tier) -> None:
        self._clear_host(chain)
        chain.host, chain.host_source, chain.state = snap, source, ChainState.HOST
        self.host_bytes += snap.nbytes

    def _clear_host(self, chain: Chain) -> None:
        if chain.host is not None:
            self.host_bytes -= chain.host.nbytes
            chain.host = None

    def _demote(self, chain: Chain) -> None:
        """IDLE on the GPU -> host RAM (or to the history alone when host RAM is full)."""
        snap = self._snapshot_kv(chain)
        self._release_gpu(chain)
        self._set_host(chain, snap, Tier.HOST)
        self.demotions += 1
        self._make_host_room(0)

    def _drop_to_history(self, chain: Chain) -> None:
        self._clear_host(chain)
        if self.manager.has(chain.session_id):
            self._release_gpu(chain)
        chain.seq.num_cached = 0
        chain.state = ChainState.HISTORY

    def _release_gpu(self, chain: Chain) -> None:
        self.manager.release(chain.session_id)
        self.controller.release(chain.session_id)
        self.prefixes.detach(chain.prefix_holder)
        chain.prefix_holder = None

    def _snapshot_kv(self, chain: Chain) -> SessionSnapshot:
        sid = chain.session_id
        state = self.controller.state_dict(sid)
        tensors = {f"method.{k}": v for k, v in state.items() if isinstance(v, torch.Tensor)}
        plain = {k: v for k, v in state.items() if not isinstance(v, torch.Tensor)}
        if chain.queries is not None and chain.queries.q is not None:
            tensors["queries"] = chain.queries.q.cpu()
        meta = {"method_state": plain, "num_cached": chain.seq.num_cached,
                "query_count": chain.queries.count if chain.queries else []}
        return SessionSnapshot(meta=meta, kv=self.manager.snapshot(sid), tensors=tensors)

    def restore_pages(self, seq: Sequence, n_new: int = 0, allow_idle: bool = False) -> int:
        """Pages restoring the chain's host copy and appending ``n_new`` tokens would take (0 if
        there is nothing to restore)."""
        chain = self.chains.get(seq.seq_id)
        if chain is None or chain.host is None or chain.host.kv is None or self.manager.has(seq.seq_id):
            return 0
        if chain.state is not ChainState.ACTIVE and not allow_idle:
            return 0
        return int(ceil_div(chain.host.kv.lengths.long() + n_new, self.manager.page_size).sum())

    def swap_out(self, seq: Sequence) -> bool:
        """A running session is preempted: its KV and method state go to host memory (the scheduler
        readmits it through ``restore``, and it goes on where it stopped). False when ``seq`` is no
        session's or host memory has no room for it (the caller then drops its KV)."""
        chain = self.chains.get(seq.seq_id)
        if chain is None or not self.manager.has(seq.seq_id):
            return False
        snap = self._snapshot_kv(chain)
        if self.host_bytes + snap.nbytes > self.host_limit and not self._make_host_room(snap.nbytes, keep=chain):
            return False
        self._release_gpu(chain)
        self._set_host(chain, snap, Tier.HOST)
        chain.state = ChainState.ACTIVE  # still running its turn, with its KV in host memory
        self.swaps += 1
        return True

    def _make_host_room(self, nbytes: int, keep: Chain | None = None) -> bool:
        """Drop idle sessions' host copies (least recently used first, ``keep`` spared) to their
        history until ``nbytes`` more fit in ``host_cache_gb``."""
        victims = sorted((c for c in self.chains.values() if c.state is ChainState.HOST and c is not keep),
                         key=lambda c: c.last_used)
        for c in victims:
            if self.host_bytes + nbytes <= self.host_limit:
                break
            self._drop_to_history(c)
        return self.host_bytes + nbytes <= self.host_limit

    def preempted(self, seq: Sequence) -> None:
        """A running session lost its cache to preemption: it will re-prefill its history."""
        chain = self.chains.get(seq.seq_id)
        if chain is not None:
            self.prefixes.detach(chain.prefix_holder)
            chain.prefix_holder = None

    def restore(self, seq: Sequence) -> None:
        """Bring a chain's host copy back onto the GPU (called by the scheduler at admission)."""
        chain = self.chains[seq.seq_id]
        snap = chain.host
        self.manager.restore(seq.seq_id, snap.kv)
        self.controller.admit(SeqInfo(seq.seq_id, snap.meta["num_cached"], seq.protected_len), chain.spec)
        state = dict(snap.meta.get("method_state", {}))
        state.update({k[len("method."):]: v.to(self.manager.device) for k, v in snap.tensors.items() if k.startswith("method.")})
        if state:
            self.controller.load_state_dict(seq.seq_id, state)
        if "queries" in snap.tensors and chain.queries is not None:
            chain.queries.q = snap.tensors["queries"].to(self.manager.device)
            chain.queries.count = list(snap.meta.get("query_count", []))
        seq.num_cached = snap.meta["num_cached"]
        self._clear_host(chain)

    def _ensure_on_gpu(self, chain: Chain) -> None:
        """Pruning works on GPU-resident KV: bring a chain in host RAM back first."""
        if chain.state is not ChainState.HOST:
            return
        need = self.restore_pages(chain.seq, allow_idle=True)
        if need > self.manager.pool.num_free:
            self.reclaim(need - self.manager.pool.num_free)
        if (self.manager.num_free_slots == 0 and not self.reclaim_slot()) or need > self.manager.pool.num_free:
            raise SessionError(f"session {chain.session_id!r} is in host RAM and the GPU pool has no room for it now")
        self.restore(chain.seq)
        chain.state = ChainState.IDLE

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
        eng = self.engine
        seq = eng.new_sequence(child_id, list(parent.history), parent.seq.params, parent.spec)
        seq.num_cached = parent.seq.num_cached
        seq.protected_len = parent.seq.protected_len
        seq.finish_idle()
        child = Chain(session_id=child_id, seq=seq, spec=parent.spec, turn_index=parent.turn_index,
                      spans=[TaggedSpan(**vars(s)) for s in parent.spans], prune_log=list(parent.prune_log),
                      pruned_tokens=parent.pruned_tokens)
        if parent.queries is not None:
            child.queries = QueryWindow(parent.queries.size, parent.queries.num_layers,
                                        None if parent.queries.q is None else parent.queries.q.clone(),
                                        list(parent.queries.count))
        if parent.state is ChainState.IDLE:
            if self.manager.num_free_slots == 0 and not self.reclaim_slot():
                raise SessionError("no cache slot is free for the fork")
            self.manager.fork(parent_id, child_id)
            self.controller.fork(parent_id, child_id)
            child.state = ChainState.IDLE
        elif parent.state is ChainState.HOST:
            self._set_host(child, parent.host, parent.host_source)  # shared read-only, counted twice
        else:
            child.state = ChainState.HISTORY
        self.chains[child_id] = child

    def end(self, session_id: Hashable) -> None:
        chain = self._get(session_id)
        if chain.state is ChainState.ACTIVE:
            self.engine.abort(session_id)
        if self.manager.has(session_id):
            self._release_gpu(chain)
        self._clear_host(chain)
        del self.chains[session_id]

    def info(self, session_id: Hashable) -> dict[str, Any]:
        chain = self._get(session_id)
        mgr = self.manager
        on_gpu = mgr.has(session_id)
        return {
            "session_id": session_id,
            "state": chain.state.value,
            "turn_index": chain.turn_index,
            "generation": chain.generation,
            "num_tokens": len(chain.history),
            "digest": chain.digest,
            "method": chain.spec.method,
            "spec": {"method": chain.spec.method, "budget": chain.spec.budget, "budget_ratio": chain.spec.budget_ratio,
                     "method_args": dict(chain.spec.method_args)},
            "kv_tokens": int(mgr.seq_lengths(session_id).sum()) if on_gpu else 0,
            "kv_pages": mgr.num_pages(session_id) if on_gpu else 0,
            "pruned_tokens": chain.pruned_tokens,
            "prune_log": list(chain.prune_log),
            "shared_prefix_tokens": chain.seq.protected_len,
            "spans": [{"start": s.start, "end": s.end, "role": s.role, "turn": s.turn, "pruned": s.pruned}
                      for s in chain.spans],
            "last_token": chain.history[-1] if chain.history else None,
        }

    # --- snapshots for the session store ------------------------------------------------------------
    def snapshot(self, session_id: Hashable, with_kv: bool = True) -> SessionSnapshot:
        """The whole session (history, metadata, KV and method state) for a store; between turns."""
        chain = self._get(session_id)
        if chain.state is ChainState.ACTIVE:
            raise SessionBusy(f"session {session_id!r} is running a turn")
        if with_kv and chain.state is ChainState.IDLE:
            snap = self._snapshot_kv(chain)
        elif with_kv and chain.state is ChainState.HOST:
            snap = SessionSnapshot(meta=dict(chain.host.meta), kv=chain.host.kv, tensors=dict(chain.host.tensors))
        else:
            snap = SessionSnapshot(meta={"num_cached": 0}, kv=None)
        snap.meta.update({
            "session_id": session_id, "turn_index": chain.turn_index, "generation": chain.generation,
            "tokens": np.asarray(chain.history, dtype="<u4").tobytes(), "digest": chain.digest,
            "spans": [[s.start, s.end, s.role, s.turn, s.pruned] for s in chain.spans], "prune_log": chain.prune_log,
            "method": {"method": chain.spec.method, "budget": chain.spec.budget, "budget_ratio": chain.spec.budget_ratio,
                       "method_args": chain.spec.method_args},
            "protected_len": chain.seq.protected_len, "pruned_tokens": chain.pruned_tokens,
            "fingerprint": self.engine.fingerprint(),
        })
        return snap

    def load(self, snap: SessionSnapshot, source: Tier = Tier.STORE) -> None:
        """Make a session from a store snapshot; its KV comes onto the GPU on the next turn. A
        snapshot whose KV is missing or was made by another model/setup is rebuilt (RECOMPUTE)."""
        meta = snap.meta
        sid = meta["session_id"]
        if sid in self.chains:
            raise SessionExists(f"session {sid!r} already exists on this engine")
        tokens = np.frombuffer(meta["tokens"], dtype="<u4").astype(np.int64).tolist()
        if history_digest(tokens) != meta["digest"]:
            raise SessionError(f"session {sid!r}: the snapshot's history does not match its digest")
        m = meta["method"]
        spec = MethodSpec(m["method"], m["budget"], m["budget_ratio"], dict(m["method_args"]))
        self.engine.controller.method_for(spec)
        eng = self.engine
        seq = eng.new_sequence(sid, tokens, SamplingParams(), spec)
        seq.protected_len = meta.get("protected_len", 0)
        seq.finish_idle()
        chain = Chain(session_id=sid, seq=seq, spec=spec, turn_index=meta["turn_index"], generation=meta["generation"],
                      spans=[TaggedSpan(a, b, r, turn=t, pruned=p) for a, b, r, t, p in meta["spans"]],
                      prune_log=list(meta["prune_log"]), pruned_tokens=meta.get("pruned_tokens", 0))
        if eng.config.prune_policy == "keep_ratio":
            chain.queries = QueryWindow(eng.config.prune_window, self.manager.num_layers)
        usable = snap.kv is not None and meta.get("fingerprint") == eng.fingerprint()
        if usable:
            self._set_host(chain, snap, source)
            seq.num_cached = snap.meta["num_cached"]
        else:
            chain.state = ChainState.HISTORY
        self.chains[sid] = chain
