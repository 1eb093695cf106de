"""The stored session's format, shared by both stores: the meta hash's fields and their codec, the
per-chunk ``Checksum`` and the fence's signed bytes.

The meta hash fields: the session record (what ``ChainCache.snapshot`` produces minus the KV
state, see ``engine.chain.KV_STATE_KEYS``): ``session_id``, ``turn_index``, ``generation``,
``tokens`` (the token history, uint32 little-endian), ``digest``, ``fingerprint``, ``method``,
``spans``, ``prune_log``, ... ; plus ``format``, ``kv`` (the chunk manifest: count, sizes,
checksum algorithm, per-chunk checksums), ``app`` (the sidecar's own metadata) and timestamps.
The KV chunks are a ``SessionSnapshot`` byte string (engine/cache/snapshot.py) cut into pieces.
Values are raw bytes, ASCII numbers or msgpack; no pickle anywhere.

Each chunk is verified against the checksum the meta records for it (``Checksum``, SHA-256; a keyed
HMAC replaces it when a key is configured, and the meta is then signed too: sidecar/store/integrity.py).
A signed fence's HMAC covers ``fence_bytes``: the fence's generation bound to the session key.
"""

from __future__ import annotations

import hashlib
import hmac
import time
from dataclasses import dataclass, field
from typing import Any

import msgpack

from sidecar.store.errors import StoreError

FORMAT = b"chainkv-session/1"

_INT_FIELDS = ("generation", "turn_index")
_RAW_FIELDS = ("tokens",)
_STR_FIELDS = ("session_id", "digest", "fingerprint")
_STORE_FIELDS = ("format", "kv", "app", "updated_at", "expires_at", "mac")


class Checksum:
    """Per-chunk checksums: SHA-256. The seam for keyed integrity: a subclass with another
    ``name`` (e.g. ``hmac-sha256``) and a keyed ``compute`` replaces it; a reader refuses chunks
    whose manifest names another algorithm (the session is then rebuilt from its history)."""

    name = "sha256"

    def compute(self, data: bytes, where: tuple = ()) -> str:
        """``where``: (session key, chunk version, chunk index), for checksums bound to a chunk's place."""
        return hashlib.sha256(data).hexdigest()

    def verify(self, data: bytes, expected: str, where: tuple = ()) -> bool:
        return hmac.compare_digest(self.compute(data, where), expected)


@dataclass
class StoredSession:
    """One committed session: its record, the sidecar's metadata and (when asked for) its KV."""

    record: dict[str, Any]
    """The session record: everything needed to rebuild the KV from the token history."""
    app: dict[str, Any] = field(default_factory=dict)
    """The sidecar's own metadata (idempotency records, tool digest, ...)."""
    kv: bytes | None = None
    """The KV blob (verified), or None: not asked for, not stored, or unusable (see ``kv_error``)."""
    kv_error: str | None = None
    """Why a stored KV blob could not be used (a missing chunk, a checksum mismatch, ...)."""
    updated_at: float = 0.0

    @property
    def generation(self) -> int:
        return int(self.record["generation"])

    @property
    def turn_index(self) -> int:
        return int(self.record["turn_index"])


def fence_bytes(key: str, generation: int) -> bytes:
    """What a signed fence's HMAC covers: its generation, bound to the session key."""
    return msgpack.packb(["chainkv-fence/1", key, int(generation)], use_bin_type=True)


# --- the field codec (shared by both stores) --------------------------------------------------------
def encode_fields(stored: StoredSession, manifest: dict[str, Any], ttl_s: float) -> dict[str, bytes]:
    clash = set(stored.record) & set(_STORE_FIELDS)
    if clash:
        raise StoreError(f"session record keys collide with store fields: {sorted(clash)}")
    out: dict[str, bytes] = {}
    for k, v in stored.record.items():
        if k in _INT_FIELDS:
            out[k] = str(int(v)).encode()
        elif k in _RAW_FIELDS:
            out[k] = bytes(v)
        elif k in _STR_FIELDS:
            out[k] = str(v).encode()
        else:
            out[k] = msgpack.packb(v, use_bin_type=True)
    now = time.time()
    out.update(
        {
            "format": FORMAT,
            "kv": msgpack.packb(manifest, use_bin_type=True),
            "app": msgpack.packb(stored.app, use_bin_type=True),
            "updated_at": repr(now).encode(),
            "expires_at": repr(now + ttl_s).encode(),
        }
    )
    return out


def decode_fields(fields: dict) -> tuple[StoredSession, dict[str, Any], float]:
    """(session without KV, chunk manifest, expires_at) from a meta hash."""
    f = {(k.decode() if isinstance(k, bytes) else k): v for k, v in fields.items()}
    if f.get("format") != FORMAT:
        raise StoreError(f"unknown session format {f.get('format')!r}")
    try:
        record: dict[str, Any] = {}
        for k, v in f.items():
            if k in _STORE_FIELDS:
                continue
            if k in _INT_FIELDS:
                record[k] = int(v)
            elif k in _RAW_FIELDS:
                record[k] = bytes(v)
            elif k in _STR_FIELDS:
                record[k] = v.decode()
            else:
                record[k] = msgpack.unpackb(v, raw=False)
        manifest = msgpack.unpackb(f["kv"], raw=False)
        app = msgpack.unpackb(f["app"], raw=False)
        updated, expires = float(f["updated_at"]), float(f["expires_at"])
    except (KeyError, ValueError, msgpack.UnpackException) as e:
        raise StoreError(f"the session's meta is unreadable: {e}") from None
    return StoredSession(record=record, app=app, updated_at=updated), manifest, expires
