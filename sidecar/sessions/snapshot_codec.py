"""Engine snapshots <-> store records: what of a session goes in the record, what in the KV blob.

``split_snapshot`` cuts an engine ``SessionSnapshot`` into the session record (the store's meta:
history, spans, method, ...) and the KV blob (the KV, method state and query window as
``SessionSnapshot`` bytes); ``join_snapshot`` puts them back together, or, when the blob is
missing or unusable, gives a record-only snapshot that the engine rebuilds by re-prefilling the
history (tier RECOMPUTE). Pure functions: the session manager loads with them, the snapshot
writer saves with them.
"""

from __future__ import annotations

from typing import Any

from engine.api import KV_STATE_KEYS, SessionSnapshot, SnapshotError
from sidecar.store.record import StoredSession


def split_snapshot(snap: SessionSnapshot, app: dict[str, Any]) -> StoredSession:
    record = {k: v for k, v in snap.meta.items() if k not in KV_STATE_KEYS}
    blob = None
    if snap.kv is not None:
        kv_meta = {k: v for k, v in snap.meta.items() if k in KV_STATE_KEYS}
        blob = SessionSnapshot(meta=kv_meta, kv=snap.kv, tensors=snap.tensors).to_bytes()
    return StoredSession(record=record, app=app, kv=blob)


def join_snapshot(stored: StoredSession) -> tuple[SessionSnapshot, str | None]:
    """The engine snapshot for a stored session, and why its KV was not usable (None if it was)."""
    error = stored.kv_error
    if stored.kv is not None:
        try:
            part = SessionSnapshot.from_bytes(stored.kv)
        except SnapshotError as e:
            error = f"the KV blob is unreadable: {e}"
        else:
            return SessionSnapshot(meta={**stored.record, **part.meta}, kv=part.kv, tensors=part.tensors), None
    return SessionSnapshot(meta={**stored.record, "num_cached": 0}, kv=None), error
