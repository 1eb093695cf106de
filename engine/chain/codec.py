"""The session record in a snapshot's metadata: what a store keeps besides the KV.

``encode_record`` adds a chain's record (history, turn index, spans, prune log, method, ...) to a
snapshot's metadata; ``decode_record`` reads it back and checks the history against its digest.
The KV state that travels with the KV itself (``KV_STATE_KEYS``) is written by ChainTiers.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Hashable

import numpy as np

from engine.cache.snapshot import SessionSnapshot
from engine.chain.errors import SessionError
from engine.chain.records import Chain, PruneRecord, TaggedSpan, history_digest
from engine.method_spec import MethodSpec

KV_STATE_KEYS = ("method_state", "num_cached", "query_count")
"""Snapshot metadata that describes the KV itself and travels with it; the rest of a snapshot's
metadata is the session record (history, spans, method, ...), enough to rebuild the KV."""


def encode_record(snap: SessionSnapshot, chain: Chain, fingerprint: str) -> SessionSnapshot:
    """Write ``chain``'s session record into ``snap.meta`` (returns ``snap``)."""
    snap.meta.update(
        {
            "session_id": chain.session_id,
            "turn_index": chain.turn_index,
            "generation": chain.generation,
            "tokens": np.asarray(chain.history, dtype="<u4").tobytes(),
            "digest": chain.digest,
            "spans": [[s.start, s.end, s.role, s.turn, s.pruned] for s in chain.spans],
            "prune_log": [dataclasses.asdict(r) for r in chain.prune_log],
            "method": chain.spec.to_record(),
            "protected_len": chain.seq.protected_len,
            "pruned_tokens": chain.pruned_tokens,
            "fingerprint": fingerprint,
        }
    )
    return snap


@dataclass
class SessionRecord:
    """A snapshot's session record, decoded and checked."""

    session_id: Hashable
    tokens: list[int]
    spec: MethodSpec
    turn_index: int
    generation: int
    spans: list[TaggedSpan]
    prune_log: list[PruneRecord]
    pruned_tokens: int
    protected_len: int
    fingerprint: str | None


def decode_record(snap: SessionSnapshot) -> SessionRecord:
    meta = snap.meta
    sid = meta["session_id"]
    tokens = np.frombuffer(meta["tokens"], dtype="<u4").astype(np.int64).tolist()
    if history_digest(tokens) != meta["digest"]:
        raise SessionError(f"session {sid!r}: the snapshot's history does not match its digest")
    return SessionRecord(
        session_id=sid,
        tokens=tokens,
        spec=MethodSpec.from_record(meta["method"]),
        turn_index=meta["turn_index"],
        generation=meta["generation"],
        spans=[TaggedSpan(a, b, r, turn=t, pruned=p) for a, b, r, t, p in meta["spans"]],
        prune_log=[PruneRecord.from_record(e) for e in meta["prune_log"]],
        pruned_tokens=meta.get("pruned_tokens", 0),
        protected_len=meta.get("protected_len", 0),
        fingerprint=meta.get("fingerprint"),
    )
