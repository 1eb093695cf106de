"""Cache control over HTTP, mapped onto sessions: SparseEngine's ``/v1/prefix_cache/...`` endpoints.

SparseEngine's prefix cache is a tree of prompts; chainkv's unit of cached KV is a session (a chain
of turns), so each endpoint names one session (``session_id``, or ``chain_id`` as the chain protocol
calls it) of the caller's tenant:

- ``inspect``: where the session's KV is (tier ``gpu``, ``host``, ``history``: no KV, the next turn
  re-prefills; ``store``: only the store holds it), its history and resident KV, its method, its
  eviction priority, and per tagged span the KV tokens it keeps (measured on the GPU, else derived
  from the prune log), plus the prune log.
- ``match``: how much of a chat request (``messages``, with its ``tools`` and ``chainkv`` method, at
  the top level or under ``chat``) the session already holds: the messages of the request its
  transcript covers, and its history and resident KV tokens. Without a ``session_id`` this
  replica's transcript index finds the session.
- ``delete_subtree``: end the session here and delete it from the store (a chain client then gets
  410 ``chain_gone``).
- ``set_eviction_priority``: ``priority`` in [-1000, 1000] (default 0); idle sessions of a lower
  priority are demoted first (GPU -> host RAM -> history), least recently used first within one.
  It travels with the session's snapshot.
- ``prune``: asynchronous (202 and a ``prune_id``; ``GET /v1/prefix_cache/prune/{prune_id}``):
  PruneHistory's machinery on ranges of history positions (sidecar/turns/prune.py).

A session of another tenant is answered exactly as a missing one (404 ``session_not_found``, the
same lookups, the same body).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from engine.api import PruneRecord, SessionInfo, SessionNotFound
from sidecar.engine_bridge.client import PruneSpec
from sidecar.http import cache_requests as cr
from sidecar.http import requests as rq
from sidecar.http.backend import SessionBackend
from sidecar.http.chat_completions import ChatCompletions, parse_messages, transcript_digests
from sidecar.http.conversations import transcript_digest
from sidecar.http.errors import OpenAIError, invalid
from sidecar.http.prune_jobs import PruneJobs
from sidecar.session_ids import SessionKey
from sidecar.sessions.record import Session
from sidecar.store.record import StoredSession
from sidecar.turns.request import TurnRequest

TIERS = {"active": "gpu", "idle": "gpu", "host": "host", "history": "history"}


def not_found(session_id: str) -> OpenAIError:
    return OpenAIError(404, f"no session {session_id!r}", "not_found_error", "session_id", "session_not_found")


class CacheControl:
    def __init__(self, backend: SessionBackend, chat: ChatCompletions, jobs: PruneJobs | None = None):
        self.backend = backend
        self.chat = chat
        self.jobs = jobs or PruneJobs()

    async def _live(self, key: str) -> Session | None:
        s = self.backend.local(key)
        return s if s is not None and s.in_engine else None

    async def _info(self, key: str, session_id: str) -> SessionInfo:
        try:
            return await self.backend.session_info(key)
        except SessionNotFound:  # ended meanwhile
            raise not_found(session_id) from None

    # --- inspect ---------------------------------------------------------------------------------------
    async def inspect(self, body: dict[str, Any], authorization: str | None) -> dict[str, Any]:
        tenant = self.backend.tenant(authorization)
        sid = cr.session_id_of(body)
        key = self.backend.key(tenant, sid)
        s = await self._live(key)
        if s is not None:
            info = await self._info(key, sid)
            kept = await self.backend.span_kv_tokens(key)
            return _describe(sid, info, s.eviction_priority, kept)
        stored = await self.backend.stored(key)
        if stored is None:
            raise not_found(sid)
        return _describe_stored(sid, stored)

    # --- match -----------------------------------------------------------------------------------------
    async def match(self, body: dict[str, Any], authorization: str | None) -> dict[str, Any]:
        tenant = self.backend.tenant(authorization)
        chat = body.get("chat", body)
        if not isinstance(chat, dict):
            raise invalid("chat must be an object holding messages", "chat")
        messages = parse_messages(chat.get("messages"))
        base = TurnRequest()
        rq.set_tools(base, chat.get("tools"), nested=True)
        rq.set_extension(base, chat)
        _, digests = transcript_digests(tenant, messages, base)
        named = body.get("session_id") is not None or body.get("chain_id") is not None
        if named:
            sid = cr.session_id_of(body)
            key = self.backend.key(tenant, sid)
        else:
            key = next((k for k in map(self.chat.index.get, reversed(digests[1:])) if k is not None), None)
            if key is None:
                return _match(None, 0, len(messages), 0, 0, None)
            sid = SessionKey.id_of(key)
        s = await self._live(key)
        if s is not None:
            have, info = transcript_digest(s.front, s.turn_index), await self._info(key, sid)
            tokens, kv, tier = info.num_tokens, info.kv_tokens, TIERS.get(info.state)
        else:
            stored = await self.backend.stored(key)
            if stored is None:
                if named:
                    raise not_found(sid)
                return _match(None, 0, len(messages), 0, 0, None)
            front = stored.app.get("front") if isinstance(stored.app.get("front"), dict) else {}
            have, tokens, kv, tier = transcript_digest(front, stored.turn_index), _stored_tokens(stored), 0, "store"
        k = next((k for k in range(len(messages), 0, -1) if digests[k].hex() == have), 0) if have else 0
        return _match(sid, k, len(messages), tokens if k else 0, kv if k else 0, tier)

    # --- delete, priority --------------------------------------------------------------------------------
    async def delete_subtree(self, body: dict[str, Any], authorization: str | None) -> dict[str, Any]:
        tenant = self.backend.tenant(authorization)
        sid = cr.session_id_of(body)
        key = self.backend.key(tenant, sid)
        try:
            here, deleted = await self.backend.end_session(key)
        except SessionNotFound:
            raise not_found(sid) from None
        self.chat.index.drop(key)
        return {
            "object": "prefix_cache.delete_subtree",
            "session_id": sid,
            "deleted": True,
            "ended_here": here,
            "deleted_from_store": deleted,
        }

    async def set_eviction_priority(self, body: dict[str, Any], authorization: str | None) -> dict[str, Any]:
        tenant = self.backend.tenant(authorization)
        sid = cr.session_id_of(body)
        priority = cr.priority_of(body)
        key = self.backend.key(tenant, sid)
        s = await self.backend.find(key)
        if s is None:
            raise not_found(sid)
        try:
            await self.backend.set_eviction_priority(s, priority)
        except SessionNotFound:
            raise not_found(sid) from None
        return {"object": "prefix_cache.eviction_priority", "session_id": sid, "eviction_priority": priority}

    # --- prune -------------------------------------------------------------------------------------------
    async def prune(self, body: dict[str, Any], authorization: str | None) -> dict[str, Any]:
        """Check the order and queue it: the job's status (202)."""
        tenant = self.backend.tenant(authorization)
        order = cr.prune_order(body)
        sid = order.session_id
        key = self.backend.key(tenant, sid)
        if await self.backend.find(key) is None:
            raise not_found(sid)
        cr.check_within(order, (await self._info(key, sid)).num_tokens)
        specs = [
            PruneSpec(span=(a, b), policy=order.policy, keep_ratio=order.keep_ratio(a, b), scope=order.scope)
            for a, b in order.ranges
        ]

        async def work() -> dict[str, Any]:
            try:
                result = await self.backend.prune(key, specs)
            except SessionNotFound:
                raise not_found(sid) from None
            return {
                "pruned_tokens": result.pruned_tokens,
                "removed_kv_entries": result.removed,
                "history_tokens": result.session.num_tokens,
                "kv_tokens": result.session.kv_tokens,
                "generation": result.session.generation,
            }

        echo = {
            "ranges": [list(r) for r in order.ranges],
            "keep_tokens": order.keep_tokens,
            "policy": order.policy,
            "scope": order.scope,
        }
        return self.jobs.submit(tenant, sid, echo, work).body()

    def prune_status(self, prune_id: str, authorization: str | None) -> dict[str, Any]:
        tenant = self.backend.tenant(authorization)
        job = self.jobs.get(tenant, prune_id)
        if job is None:
            raise OpenAIError(404, f"no pruning {prune_id[:200]!r}", "not_found_error", "prune_id", "prune_not_found")
        return job.body()


def _match(sid: str | None, k: int, n: int, tokens: int, kv: int, tier: str | None) -> dict[str, Any]:
    return {
        "object": "prefix_cache.match",
        "session_id": sid,
        "matched_messages": k,
        "total_messages": n,
        "matched_tokens": tokens,
        "resident_kv_tokens": kv,
        "tier": tier,
    }


def _describe(sid: str, info: SessionInfo, priority: int, kept: tuple[float, ...] | None) -> dict[str, Any]:
    spans = [
        {
            "start": sp.start,
            "end": sp.end,
            "role": sp.role,
            "turn": sp.turn,
            "pruned": sp.pruned,
            "kept_tokens": round(kept[i], 2) if kept is not None else _kept_by_log(sp.start, sp.end, info.prune_log),
        }
        for i, sp in enumerate(info.spans)
    ]
    return {
        "object": "prefix_cache.session",
        "session_id": sid,
        "tier": TIERS.get(info.state, info.state),
        "state": info.state,
        "turn_index": info.turn_index,
        "generation": info.generation,
        "history_tokens": info.num_tokens,
        "kv_tokens": info.kv_tokens,
        "pruned_kv_tokens": info.pruned_tokens,
        "shared_prefix_tokens": info.shared_prefix_tokens,
        "method": info.spec.to_record(),
        "eviction_priority": priority,
        "kept_tokens_source": "gpu" if kept is not None else "prune_log",
        "spans": spans,
        "prune_log": [dataclasses.asdict(p) for p in info.prune_log],
    }


def _describe_stored(sid: str, stored: StoredSession) -> dict[str, Any]:
    rec = stored.record
    log = tuple(PruneRecord.from_record(e) for e in rec.get("prune_log", []))
    spans = [
        {"start": a, "end": b, "role": r, "turn": t, "pruned": p, "kept_tokens": _kept_by_log(a, b, log)}
        for a, b, r, t, p in rec.get("spans", [])
    ]
    priority = stored.app.get("eviction_priority", 0)
    return {
        "object": "prefix_cache.session",
        "session_id": sid,
        "tier": "store",
        "state": "stored",
        "turn_index": stored.turn_index,
        "generation": stored.generation,
        "history_tokens": _stored_tokens(stored),
        "kv_tokens": 0,
        "pruned_kv_tokens": rec.get("pruned_tokens", 0),
        "shared_prefix_tokens": rec.get("protected_len", 0),
        "method": rec.get("method") if isinstance(rec.get("method"), dict) else {},
        "eviction_priority": priority if isinstance(priority, int) else 0,
        "kept_tokens_source": "prune_log",
        "spans": spans,
        "prune_log": [dataclasses.asdict(p) for p in log],
    }


def _stored_tokens(stored: StoredSession) -> int:
    return len(stored.record.get("tokens", b"")) // 4


def _kept_by_log(start: int, end: int, log: tuple[PruneRecord, ...]) -> float:
    """The tokens of [start, end) whose KV the prune log says are kept (the method's own eviction
    is not in it): a dropped part keeps none, a ``keep_ratio`` part its ratio, rounded up."""
    kept = float(end - start)
    for p in log:
        overlap = min(end, p.end) - max(start, p.start)
        if overlap > 0:
            kept -= overlap - (math.ceil(p.keep_ratio * overlap) if p.policy == "keep_ratio" else 0)
    return max(0.0, kept)
