"""SessionStore: the save / load / delete protocol and the freshness fence, over primitive reads and
writes that each store provides (sidecar/store/redis_store.py, sidecar/store/directory_store.py).

A write puts the chunks first, then commits the meta on the *expected generation* (the one the
writer loaded or last committed; none for a new session): Redis checks it in a Lua script, the
directory store under its lock. Readers trust only the chunks the committed meta lists, and each
chunk is verified against the checksum the meta records for it (sidecar/store/record.py). Every key
has a TTL (the directory store records ``expires_at`` and treats expired sessions as gone).

Freshness. Beside the meta, each session has a *fence*: the highest generation ever committed
for it (``<prefix>:{<key>}:fence`` in Redis, ``fence`` in the session's folder), raised in the
same atomic step as each commit and never lowered (signed with the snapshot HMAC key when one is
configured, and bound to the session key). A meta older than its fence (an older, validly signed
record put back, a replica promoted from a lagging copy, a backup restored over newer data) is
refused with ``SnapshotRolledBack``: it is never served as the current session. A commit never
writes a generation below the fence.
"""

from __future__ import annotations

import secrets
import time
from typing import Any

from sidecar.session_ids import SessionKey
from sidecar.store.errors import (
    GenerationConflict,
    SnapshotRejected,
    SnapshotRolledBack,
    StoreError,
    StoreUnavailable,
)
from sidecar.store.record import Checksum, StoredSession, decode_fields, encode_fields, fence_bytes

DEFAULT_TTL_S = 7 * 24 * 3600
DEFAULT_CHUNK_BYTES = 4 * 2**20


class SessionStore:
    """The format and protocol; subclasses provide the primitive reads and writes."""

    kind = "abstract"

    def __init__(
        self,
        ttl_s: float = DEFAULT_TTL_S,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        checksum: Checksum | None = None,
        hmac_keys: Any = None,
    ):
        """``hmac_keys``: a ``sidecar.store.integrity.SnapshotKeys``; the meta is then signed and checked,
        and the chunks carry HMACs (see sidecar/store/integrity.py)."""
        if ttl_s <= 0 or chunk_bytes <= 0:
            raise ValueError("ttl_s and chunk_bytes must be positive")
        self.ttl_s = ttl_s
        self.chunk_bytes = chunk_bytes
        self.hmac_keys = hmac_keys
        self.checksum = checksum or (hmac_keys.checksum() if hmac_keys is not None else Checksum())

    # --- the protocol -------------------------------------------------------------------------------
    def save(self, key: str, stored: StoredSession, expected_generation: int | None) -> None:
        """Write the chunks, then commit the meta if the store still holds ``expected_generation``
        (None: the session must not exist). Raises GenerationConflict or StoreUnavailable."""
        version = f"{stored.generation}.{secrets.token_hex(4)}"
        blob = stored.kv or b""
        chunks = [blob[i : i + self.chunk_bytes] for i in range(0, len(blob), self.chunk_bytes)]
        manifest = {
            "version": version,
            "chunks": len(chunks),
            "bytes": len(blob),
            "checksum": self.checksum.name,
            "sums": [self.checksum.compute(c, (key, version, i)) for i, c in enumerate(chunks)],
        }
        fields = encode_fields(stored, manifest, self.ttl_s)
        if self.hmac_keys is not None:
            self.hmac_keys.sign_meta(key, fields)
        fields_fence = self.fence_value(key, stored.generation)
        if chunks:
            self._write_chunks(key, version, chunks)
        try:
            old = self._commit(key, fields, expected_generation, fields_fence)
        except GenerationConflict:
            self._delete_chunks(key, version, len(chunks))
            raise
        if old and old.get("chunks"):
            self._delete_chunks(key, old["version"], old["chunks"])

    def load(self, key: str, with_kv: bool = True) -> StoredSession | None:
        """The committed session, or None. Its KV is verified chunk by chunk; a missing or
        damaged chunk leaves ``kv`` None and says why in ``kv_error``."""
        for _attempt in range(3):
            fields = self._read_meta(key)
            if not fields:
                return None
            if self.hmac_keys is not None:
                self.hmac_keys.check_meta(key, fields)  # SnapshotRejected: nothing of it is used
            stored, manifest, expires = decode_fields(fields)
            if expires < time.time():
                return None
            fence = self.fence(key)
            if fence is not None and stored.generation < fence:
                raise SnapshotRolledBack(key, stored.generation, fence)
            if not with_kv or not manifest.get("chunks"):
                return stored
            if manifest.get("checksum") != self.checksum.name:
                stored.kv_error = (
                    f"the KV was sealed with {manifest.get('checksum')!r}, this store checks {self.checksum.name!r}"
                )
                return stored
            parts = self._read_chunks(key, manifest["version"], manifest["chunks"])
            missing = [i for i, p in enumerate(parts) if p is None]
            if missing:
                if self._meta_version(key) != manifest["version"]:
                    continue  # a newer commit replaced these chunks while we read: read again
                stored.kv_error = f"KV chunk {missing[0]} of {manifest['chunks']} is missing"
                return stored
            where = [(key, manifest["version"], i) for i in range(len(parts))]
            bad = [
                i
                for i, (p, s, w) in enumerate(zip(parts, manifest["sums"], where))
                if not self.checksum.verify(p, s, w)
            ]
            if bad:
                stored.kv_error = f"KV chunk {bad[0]} of {manifest['chunks']} fails its {self.checksum.name} checksum"
                return stored
            blob = b"".join(parts)
            if len(blob) != manifest["bytes"]:
                stored.kv_error = "the KV chunks do not add up to the recorded size"
                return stored
            stored.kv = blob
            return stored
        raise StoreUnavailable(f"session {key!r} kept changing while it was read")

    def delete(self, key: str) -> bool:
        """Remove a session's meta and chunks; True if it existed."""
        raise NotImplementedError

    def ping(self) -> None:
        """Raise StoreUnavailable if the store cannot be reached."""

    def close(self) -> None:
        pass

    def describe(self) -> str:
        return self.kind

    # --- freshness ---------------------------------------------------------------------------------
    def fence_value(self, key: str, generation: int) -> bytes:
        """The fence bytes for ``generation``: ``<generation>`` or, with an HMAC key, ``<generation>.<mac>``."""
        if self.hmac_keys is None:
            return str(int(generation)).encode()
        return f"{int(generation)}.{self.hmac_keys.mac(fence_bytes(key, generation))}".encode()

    def parse_fence(self, key: str, raw: bytes | None) -> int | None:
        """The generation a stored fence holds (None: none). A forged or malformed fence raises StoreError."""
        if not raw:
            return None
        text = raw.decode("ascii", "replace")
        gen, _, tag = text.partition(".")
        if not gen.isdigit():
            raise StoreError(f"the freshness fence of {SessionKey.id_of(key)!r} is malformed")
        if self.hmac_keys is not None:
            if not tag or not self.hmac_keys.verify(fence_bytes(key, int(gen)), tag):
                raise SnapshotRejected(
                    f"the freshness fence of {SessionKey.id_of(key)!r} fails its HMAC; refusing the session"
                )
        return int(gen)

    def fence(self, key: str) -> int | None:
        """The highest generation ever committed for ``key`` (None: no fence recorded)."""
        return self.parse_fence(key, self._read_fence(key))

    def _meta_version(self, key: str) -> str | None:
        fields = self._read_meta(key)
        if not fields:
            return None
        _, manifest, _ = decode_fields(fields)
        return manifest.get("version")

    # --- primitives -------------------------------------------------------------------------------
    def _write_chunks(self, key: str, version: str, chunks: list[bytes]) -> None:
        raise NotImplementedError

    def _commit(self, key: str, fields: dict[str, bytes], expected: int | None, fence: bytes) -> dict[str, Any] | None:
        """Replace the meta if its generation is ``expected`` and raise the fence to ``fence`` (never
        lower it; a generation below the fence is a GenerationConflict); returns the old chunk manifest."""
        raise NotImplementedError

    def _read_fence(self, key: str) -> bytes | None:
        raise NotImplementedError

    def _read_meta(self, key: str) -> dict | None:
        raise NotImplementedError

    def _read_chunks(self, key: str, version: str, n: int) -> list[bytes | None]:
        raise NotImplementedError

    def _delete_chunks(self, key: str, version: str, n: int) -> None:
        raise NotImplementedError
