"""EndedSessions: the keys of sessions this replica ended, so a client can be told "gone" rather
than "not found".

The chain protocol of the HTTP front (sidecar/http/chain_protocol.py) answers a chain id whose
session was ended (``/v1/prefix_cache/delete_subtree``, gRPC EndSession) or expired here with 410
``chain_gone``, which its clients answer by sending the whole prompt again, and an id it never knew
with 404 ``chain_not_found``. The record is bounded (the oldest keys are forgotten first, after
which an ended session's id is simply not found) and per replica, as SparseEngine's tombstones
are per process. Keys are tenant-scoped session keys, so a tenant never learns of another's.
"""

from __future__ import annotations

from collections import OrderedDict

DEFAULT_CAPACITY = 4096


class EndedSessions:
    def __init__(self, capacity: int = DEFAULT_CAPACITY):
        if capacity < 1:
            raise ValueError("capacity must be >= 1")
        self.capacity = capacity
        self._keys: OrderedDict[str, None] = OrderedDict()

    def add(self, key: str) -> None:
        self._keys.pop(key, None)
        self._keys[key] = None
        while len(self._keys) > self.capacity:
            self._keys.popitem(last=False)

    def __contains__(self, key: object) -> bool:
        return key in self._keys

    def __len__(self) -> int:
        return len(self._keys)
