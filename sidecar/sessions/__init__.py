"""The sessions: session id -> the engine's chain, on this replica and in the store.

manager.py (``SessionManager``: lookup, per-session ordering, idempotency, ending; the store's one
owner), loading.py (a session fetched from the store and loaded into the engine), record.py (the
sidecar's record of a session and of its running turn), ended.py (the keys of sessions ended
here), snapshots.py (``SnapshotWriter``: snapshots written behind their turns), snapshot_codec.py
(an engine snapshot <-> a store record), janitor.py (expiring and freeing idle sessions).
"""
