"""The session store's errors, in a module of their own: the stores (base.py and the two
implementations) and the integrity layer (integrity.py) both raise them, and neither imports the
other for them."""

from __future__ import annotations

from sidecar.session_ids import SessionKey


class StoreError(RuntimeError):
    """The store refused an operation or holds something it cannot read."""


class StoreUnavailable(StoreError):
    """The store cannot be reached (retry later)."""


class SnapshotRolledBack(StoreError):
    """The store holds an older generation of the session than it once committed (gRPC DATA_LOSS)."""

    def __init__(self, key: str, found: int, fence: int):
        name = SessionKey.id_of(key)
        super().__init__(
            f"the stored session {name!r} is at generation {found}, but generation {fence} was "
            f"committed before: the store was rolled back; refusing to serve the older session"
        )
        self.found, self.fence = found, fence


class GenerationConflict(StoreError):
    """The committed generation is not the one the writer expected: another writer got there first."""

    def __init__(self, key: str, expected: int | None, found: int | None, fenced: bool = False):
        if fenced:
            super().__init__(f"session {key!r}: generation {found} was already committed; this write is older")
        else:
            super().__init__(f"session {key!r}: the store holds generation {found}, not the expected {expected}")
        self.expected, self.found, self.fenced = expected, found, fenced


class SnapshotRejected(StoreError):
    """A stored session failed authentication: tampered with, unsigned, or signed by an unknown key."""
