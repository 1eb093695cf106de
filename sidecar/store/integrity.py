"""Snapshot integrity: an HMAC-SHA256 over every stored session, so a tampered store is never loaded.

Without a key the store checks each KV chunk against a plain SHA-256 (it catches corruption, not
an attacker who can write to Redis: they can recompute it). With a key
(``--snapshot-hmac-key-file``, ``snapshot_hmac_key_file`` in YAML, ``CHAINKV_SNAPSHOT_HMAC_KEY_FILE``)
two things change:

* each KV chunk's checksum is an HMAC of (session key, chunk version, chunk index, bytes), the
  manifest naming the algorithm ``hmac-sha256``: a damaged, forged or swapped chunk is refused
  and the session rebuilt from its (authenticated) token history;
* the meta itself carries ``mac``, an HMAC of the session key and every other meta field
  (history, spans, method, fingerprint, chunk manifest, idempotency records, timestamps). A meta
  that fails it, lacks it, or was copied under another key (another tenant's session) raises
  ``SnapshotRejected``: the session is refused as a whole (gRPC ``DATA_LOSS``), nothing of it
  reaches the engine.

The key file holds one key per line (at least 16 bytes each; blank lines and ``#`` comments
ignored): the first signs, every one verifies, so keys rotate by prepending a new line, rolling
the replicas, then dropping the old line once every session was rewritten.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from pathlib import Path

import msgpack

from sidecar.session_ids import SessionKey
from sidecar.store.errors import SnapshotRejected
from sidecar.store.record import Checksum

MIN_KEY_BYTES = 16
MAC_FIELD = "mac"


class SnapshotKeys:
    """HMAC keys: ``keys[0]`` signs, all of them verify."""

    def __init__(self, keys: list[bytes]):
        if not keys:
            raise ValueError("the snapshot HMAC key file holds no key")
        for k in keys:
            if len(k) < MIN_KEY_BYTES:
                raise ValueError(f"a snapshot HMAC key must be at least {MIN_KEY_BYTES} bytes, not {len(k)}")
        self.keys = list(keys)

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> "SnapshotKeys":
        try:
            text = Path(path).read_bytes()
        except OSError as e:
            raise ValueError(f"cannot read the snapshot HMAC key file: {e}") from None
        keys = [line.split(b"#", 1)[0].strip() for line in text.splitlines()]
        return cls([k for k in keys if k])

    def mac(self, data: bytes, key: bytes | None = None) -> str:
        return hmac.new(key or self.keys[0], data, hashlib.sha256).hexdigest()

    def verify(self, data: bytes, tag: str) -> bool:
        ok = False
        for k in self.keys:  # every key, whatever matched: no timing hint about which one
            ok |= hmac.compare_digest(self.mac(data, k), tag)
        return ok

    # --- the meta --------------------------------------------------------------------------------------
    @staticmethod
    def _meta_bytes(session_key: str, fields: dict) -> bytes:
        items = []
        for k, v in fields.items():
            k = k.decode() if isinstance(k, bytes) else k
            if k != MAC_FIELD:
                items.append((k, bytes(v)))
        items.sort()
        return msgpack.packb(["chainkv-meta/1", session_key, items], use_bin_type=True)

    def sign_meta(self, session_key: str, fields: dict[str, bytes]) -> None:
        """Add ``mac`` to the meta fields about to be committed."""
        fields[MAC_FIELD] = self.mac(self._meta_bytes(session_key, fields)).encode()

    def check_meta(self, session_key: str, fields: dict) -> None:
        """Raise SnapshotRejected unless ``fields`` (as read back) carry a valid ``mac`` for ``session_key``."""
        tag = fields.get(MAC_FIELD, fields.get(MAC_FIELD.encode()))
        name = SessionKey.id_of(session_key)
        if tag is None:
            raise SnapshotRejected(f"the stored session {name!r} is not signed; refusing it (snapshot HMAC is on)")
        tag = tag.decode() if isinstance(tag, bytes) else str(tag)
        if not self.verify(self._meta_bytes(session_key, fields), tag):
            raise SnapshotRejected(
                f"the stored session {name!r} fails its HMAC (tampered with, moved from another "
                f"key, or signed with an unknown key); refusing it"
            )

    def checksum(self) -> "HmacChecksum":
        return HmacChecksum(self)


class HmacChecksum(Checksum):
    """Per-chunk HMAC bound to the chunk's place (session key, version, index)."""

    name = "hmac-sha256"

    def __init__(self, keys: SnapshotKeys):
        self.keys = keys

    @staticmethod
    def _bytes(data: bytes, where: tuple) -> bytes:
        return msgpack.packb(["chainkv-chunk/1", *where], use_bin_type=True) + data

    def compute(self, data: bytes, where: tuple = ()) -> str:
        return self.keys.mac(self._bytes(data, where))

    def verify(self, data: bytes, expected: str, where: tuple = ()) -> bool:
        return self.keys.verify(self._bytes(data, where), expected)


def load_keys(path: str | None) -> SnapshotKeys | None:
    """The keys from ``path`` (``ServerOptions.snapshot_hmac_key_file``); None when it is not set."""
    return SnapshotKeys.from_file(path) if path else None
