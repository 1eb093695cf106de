"""The transcript index in the session store: transcript digest -> session key, for every replica.

A stateless Chat Completions request finds its session by the longest prefix of its messages whose
transcript digest (sidecar/http/conversations.py) is some session's current one. Each replica keeps
that index in memory; this module keeps it in the store too, so a request that lands on another
replica (or on this one after a restart) resumes the session from its snapshot.

Entries. One per (tenant, digest), its value the session's key. The entry's name is a hash of the
tenant and the digest (fixed length, nothing of the request in it); in Redis
``<prefix>:tx:{<tenant hash>}:<name>`` (the tenant's entries share a hash tag, so one ``MGET`` reads
them in a cluster too), written with the store's TTL; in a ``DirectoryStore`` a file
``<root>/transcript+index/t-<name>`` holding ``[format, key, digest, expires_at]`` (``+`` is never in
a folder the store made, so no session folder can be this one).

Writing. An entry is written after a snapshot whose sidecar metadata carries the digest is committed
(``SnapshotWriter.on_commit``): a replica that reads it finds the session stored at that transcript.

Trust. An entry is a hint: ``find`` takes an entry only for a key of the asking tenant whose stored
session (``store.load`` without its KV) still records the digest in its front metadata. An entry whose
session is gone (ended, expired) or has moved on is ignored and deleted (only if it still holds the
value read, so a concurrent rewrite survives). Stale directory entries are also swept by ``sweep``.
"""

from __future__ import annotations

import base64
import hashlib
import logging
import re
import time
from dataclasses import dataclass
from pathlib import Path

import msgpack

from sidecar.session_ids import BadSessionId, check_id
from sidecar.store import DirectoryStore, RedisStore, SessionStore, StoredSession
from sidecar.store_errors import StoreError, StoreUnavailable

log = logging.getLogger(__name__)

FORMAT = "chainkv-transcript/1"
FOLDER = "transcript+index"
MAX_VERIFY = 8
"""At most this many entries are checked against their session per lookup (each check is a store read)."""
_ENTRY_RE = re.compile(r"t-[a-z2-7]{52}")


@dataclass(frozen=True)
class Found:
    position: int
    """Which of the digests ``find`` was given matched."""
    key: str
    stored: StoredSession
    """The session's committed record (no KV)."""

    @property
    def turn_index(self) -> int:
        return self.stored.turn_index


def tenant_of(key: str) -> str:
    """The tenant of a scoped session key (``sidecar.session_ids.scoped_key``)."""
    return key.rpartition("/")[0]


def entry_name(tenant: str, digest: bytes) -> str:
    """52 characters of ``[a-z2-7]``: base32 of SHA-256(tenant, digest)."""
    h = hashlib.sha256(b"chainkv-transcript-entry/1\0" + tenant.encode("utf-8", "surrogatepass") + b"\0" + digest)
    return base64.b32encode(h.digest()).decode().rstrip("=").lower()


class StoredTranscripts:
    """The index over one store. ``front_key``: the front metadata field holding a session's digest
    (hex); ``turn_key``: the one holding the turn index it was recorded at (when present, a digest
    recorded at another turn than the session's is not its transcript)."""

    def __init__(self, store: SessionStore, front_key: str, turn_key: str | None = None):
        self.store = store
        self.front_key = front_key
        self.turn_key = turn_key
        if isinstance(store, RedisStore):
            self.entries: _Entries = _RedisEntries(store)
        elif isinstance(store, DirectoryStore):
            self.entries = _DirectoryEntries(store)
        else:
            raise TypeError(f"no transcript index for a {type(store).__name__}")

    def put_committed(self, key: str, stored: StoredSession) -> None:
        """After ``stored`` was committed for ``key``: index it by its transcript digest, if it has one."""
        digest_hex = self.digest_of(stored)
        if digest_hex is None:
            return
        try:
            digest = bytes.fromhex(digest_hex)
        except ValueError:
            return
        self.entries.put(tenant_of(key), digest, key)

    def find(self, tenant: str, digests: list[bytes]) -> Found | None:
        """The first of ``digests`` (put the longest prefix first) whose entry names a session of
        ``tenant`` stored at that transcript; None when none does. One read for all the entries (one
        ``MGET`` in Redis), then one per entry checked (at most ``MAX_VERIFY``)."""
        if not digests:
            return None
        checked = 0
        for position, (digest, key) in enumerate(zip(digests, self.entries.get_many(tenant, digests))):
            if key is None:
                continue
            if checked >= MAX_VERIFY:
                break
            checked += 1
            if not self._ours(tenant, key):
                log.warning("transcript index entry for tenant %r names another tenant's session; deleted", tenant)
                self.entries.remove_if(tenant, digest, key)
                continue
            try:
                stored = self.store.load(key, False)
            except StoreUnavailable:
                raise
            except StoreError as e:  # a rolled-back or refused session: not a match, but not stale either
                log.info("transcript index: session %s is unusable (%s)", key, e)
                continue
            if stored is not None and self.digest_of(stored) == digest.hex():
                return Found(position, key, stored)
            self.entries.remove_if(tenant, digest, key)  # gone, expired, or moved on
        return None

    def digest_of(self, stored: StoredSession) -> str | None:
        """The stored session's transcript digest (hex), or None (none, or recorded at another turn)."""
        front = stored.app.get("front")
        if not isinstance(front, dict):
            return None
        if self.turn_key is not None and front.get(self.turn_key, stored.turn_index) != stored.turn_index:
            return None
        digest = front.get(self.front_key)
        return digest if isinstance(digest, str) else None

    @staticmethod
    def _ours(tenant: str, key: str) -> bool:
        head, sep, sid = key.rpartition("/")
        if head != tenant or bool(sep) != bool(tenant):
            return False
        try:
            check_id(sid)
        except BadSessionId:
            return False
        return True

    def sweep(self) -> int:
        """Delete expired entries (the directory store; Redis expires them itself). Returns how many."""
        return self.entries.sweep()


class _Entries:
    def get_many(self, tenant: str, digests: list[bytes]) -> list[str | None]:
        raise NotImplementedError

    def put(self, tenant: str, digest: bytes, key: str) -> None:
        raise NotImplementedError

    def remove_if(self, tenant: str, digest: bytes, key: str) -> None:
        """Delete the entry if it still names ``key``."""
        raise NotImplementedError

    def sweep(self) -> int:
        return 0


_REMOVE_IF_LUA = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


class _RedisEntries(_Entries):
    def __init__(self, store: RedisStore):
        self.store = store
        self._remove_if = store.client.register_script(_REMOVE_IF_LUA)

    def name(self, tenant: str, digest: bytes) -> str:
        tag = hashlib.sha256(b"chainkv-transcript-tenant/1\0" + tenant.encode("utf-8", "surrogatepass")).hexdigest()
        return f"{self.store.prefix}:tx:{{{tag[:32]}}}:{entry_name(tenant, digest)}"

    def get_many(self, tenant: str, digests: list[bytes]) -> list[str | None]:
        raw = self.store.call(self.store.client.mget, [self.name(tenant, d) for d in digests])
        return [v.decode("utf-8", "replace") if v is not None else None for v in raw]

    def put(self, tenant: str, digest: bytes, key: str) -> None:
        self.store.call(self.store.client.set, self.name(tenant, digest), key.encode(), ex=self.store.ttl_seconds())

    def remove_if(self, tenant: str, digest: bytes, key: str) -> None:
        self.store.call(self._remove_if, keys=[self.name(tenant, digest)], args=[key.encode()])


class _DirectoryEntries(_Entries):
    def __init__(self, store: DirectoryStore):
        self.store = store
        self.folder = store.root / FOLDER

    def path(self, tenant: str, digest: bytes) -> Path:
        return self.folder / ("t-" + entry_name(tenant, digest))

    def _read(self, path: Path, digest: bytes | None) -> str | None:
        """The key an entry file names, or None (missing, unreadable, another digest's, or expired:
        an expired one is deleted)."""
        try:
            fmt, key, digest_hex, expires_at = msgpack.unpackb(path.read_bytes(), raw=False)
        except FileNotFoundError:
            return None
        except (OSError, ValueError, TypeError, msgpack.UnpackException):
            return None
        if fmt != FORMAT or not isinstance(key, str) or (digest is not None and digest_hex != digest.hex()):
            return None
        if not isinstance(expires_at, (int, float)) or expires_at < time.time():
            path.unlink(missing_ok=True)
            return None
        return key

    def get_many(self, tenant: str, digests: list[bytes]) -> list[str | None]:
        return [self._read(self.path(tenant, d), d) for d in digests]

    def put(self, tenant: str, digest: bytes, key: str) -> None:
        try:
            self.folder.mkdir(exist_ok=True)
        except OSError as e:
            raise StoreUnavailable(f"cannot create {self.folder}: {e}") from None
        body = msgpack.packb([FORMAT, key, digest.hex(), time.time() + self.store.ttl_s], use_bin_type=True)
        self.store.atomic_write(self.path(tenant, digest), body)

    def remove_if(self, tenant: str, digest: bytes, key: str) -> None:
        path = self.path(tenant, digest)
        if self._read(path, digest) == key:
            path.unlink(missing_ok=True)

    def sweep(self) -> int:
        n = 0
        try:
            entries = list(self.folder.iterdir())
        except OSError:
            return 0
        for p in entries:
            if _ENTRY_RE.fullmatch(p.name) and not p.is_symlink() and p.is_file() and self._read(p, None) is None:
                n += not p.exists()  # ``_read`` deleted it: expired (an unreadable entry is left alone)
        return n


def sweep(store: SessionStore | None) -> int:
    """The janitor's pass over a directory store's index (Redis entries expire by their TTL)."""
    if not isinstance(store, DirectoryStore):
        return 0
    return _DirectoryEntries(store).sweep()
