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

Bounds. As in a replica's own index, a session has one entry: its latest. Each session has a pointer
to its entry (Redis ``<prefix>:txs:{<tenant hash>}:<name of the key>``, in the tenant's hash tag; a
``DirectoryStore`` file ``<root>/transcript+latest/p-<name of the key>``), and writing the session's
new entry deletes the one it points to (if that still names the session). Entries and pointers
expire with the store's TTL, so the index holds at most one entry per session stored.

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

from sidecar.session_ids import BadSessionId, SessionKey
from sidecar.store.base import SessionStore
from sidecar.store.directory_store import DirectoryStore
from sidecar.store.errors import StoreError, StoreUnavailable
from sidecar.store.record import StoredSession
from sidecar.store.redis_store import RedisStore

log = logging.getLogger(__name__)

FORMAT = "chainkv-transcript/1"
FOLDER = "transcript+index"
LATEST_FOLDER = "transcript+latest"
"""The directory store's per-session pointers to their latest entry."""
MAX_VERIFY = 8
"""At most this many entries are checked against their session per lookup (each check is a store read)."""
_ENTRY_RE = re.compile(r"t-[a-z2-7]{52}")
_POINTER_RE = re.compile(r"p-[a-z2-7]{52}")


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


def entry_name(tenant: str, digest: bytes) -> str:
    """52 characters of ``[a-z2-7]``: base32 of SHA-256(tenant, digest)."""
    h = hashlib.sha256(b"chainkv-transcript-entry/1\0" + tenant.encode("utf-8", "surrogatepass") + b"\0" + digest)
    return base64.b32encode(h.digest()).decode().rstrip("=").lower()


def pointer_name(key: str) -> str:
    """52 characters of ``[a-z2-7]``: base32 of SHA-256(session key)."""
    h = hashlib.sha256(b"chainkv-transcript-latest/1\0" + key.encode("utf-8", "surrogatepass"))
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
        self.entries.put_latest(SessionKey.tenant_of(key), digest, key)

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
        """``key`` is a well-formed key of one of ``tenant``'s sessions."""
        try:
            return SessionKey.parse(key).tenant == tenant
        except BadSessionId:
            return False

    def sweep(self) -> int:
        """Delete expired entries (the directory store; Redis expires them itself). Returns how many."""
        return self.entries.sweep()


class _Entries:
    def get_many(self, tenant: str, digests: list[bytes]) -> list[str | None]:
        raise NotImplementedError

    def put(self, tenant: str, digest: bytes, key: str) -> None:
        raise NotImplementedError

    def put_latest(self, tenant: str, digest: bytes, key: str) -> None:
        """``put``, as the session's only entry: the one its pointer names is deleted if it still names
        ``key``, and the pointer names this one."""
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


# KEYS: the new entry, the session's pointer, the entry the pointer named when read (or the new
# entry again); ARGV: the session key, the TTL. The old entry goes only if the pointer still names
# it and it still names the session (a concurrent writer's entries survive).
_PUT_LATEST_LUA = """
if KEYS[3] ~= KEYS[1] and redis.call('GET', KEYS[2]) == KEYS[3] and redis.call('GET', KEYS[3]) == ARGV[1] then
  redis.call('DEL', KEYS[3])
end
redis.call('SET', KEYS[1], ARGV[1], 'EX', ARGV[2])
redis.call('SET', KEYS[2], KEYS[1], 'EX', ARGV[2])
return 1
"""


class _RedisEntries(_Entries):
    def __init__(self, store: RedisStore):
        self.store = store
        self._remove_if = store.client.register_script(_REMOVE_IF_LUA)
        self._put_latest = store.client.register_script(_PUT_LATEST_LUA)

    def _tag(self, tenant: str) -> str:
        """The tenant's hash tag: its entries and pointers are in one cluster slot."""
        return hashlib.sha256(b"chainkv-transcript-tenant/1\0" + tenant.encode("utf-8", "surrogatepass")).hexdigest()[
            :32
        ]

    def name(self, tenant: str, digest: bytes) -> str:
        return f"{self.store.prefix}:tx:{{{self._tag(tenant)}}}:{entry_name(tenant, digest)}"

    def pointer(self, tenant: str, key: str) -> str:
        return f"{self.store.prefix}:txs:{{{self._tag(tenant)}}}:{pointer_name(key)}"

    def put_latest(self, tenant: str, digest: bytes, key: str) -> None:
        new, pointer = self.name(tenant, digest), self.pointer(tenant, key)
        old = self.store.call(self.store.client.get, pointer)
        old = old.decode("utf-8", "replace") if old is not None else new
        if not old.startswith(f"{self.store.prefix}:tx:{{{self._tag(tenant)}}}:"):
            old = new  # not an entry of this tenant's: left alone
        self.store.call(self._put_latest, keys=[new, pointer, old], args=[key.encode(), self.store.ttl_seconds()])

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

        self.latest = store.root / LATEST_FOLDER

    def path(self, tenant: str, digest: bytes) -> Path:
        return self.folder / ("t-" + entry_name(tenant, digest))

    def pointer(self, key: str) -> Path:
        return self.latest / ("p-" + pointer_name(key))

    def _read_pointer(self, path: Path) -> str | None:
        """The entry file name a pointer names, or None (missing, unreadable or expired)."""
        try:
            fmt, name, expires_at = msgpack.unpackb(path.read_bytes(), raw=False)
        except (OSError, ValueError, TypeError, msgpack.UnpackException):
            return None
        if fmt != FORMAT or not isinstance(name, str) or not _ENTRY_RE.fullmatch(name):
            return None
        if not isinstance(expires_at, (int, float)) or expires_at < time.time():
            return None
        return name

    def put_latest(self, tenant: str, digest: bytes, key: str) -> None:
        new = self.path(tenant, digest)
        old = self._read_pointer(self.pointer(key))
        if old is not None and old != new.name and self._read(self.folder / old, None) == key:
            (self.folder / old).unlink(missing_ok=True)
        self.put(tenant, digest, key)
        try:
            self.latest.mkdir(exist_ok=True)
        except OSError as e:
            raise StoreUnavailable(f"cannot create {self.latest}: {e}") from None
        body = msgpack.packb([FORMAT, new.name, time.time() + self.store.ttl_s], use_bin_type=True)
        self.store.atomic_write(self.pointer(key), body)

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
        try:
            pointers = list(self.latest.iterdir())
        except OSError:
            return n
        for p in pointers:  # expired pointers go too (not counted: they are not entries)
            if _POINTER_RE.fullmatch(p.name) and not p.is_symlink() and p.is_file() and self._expired(p):
                p.unlink(missing_ok=True)
        return n

    @staticmethod
    def _expired(path: Path) -> bool:
        try:
            expires_at = msgpack.unpackb(path.read_bytes(), raw=False)[2]
        except (OSError, ValueError, TypeError, IndexError, KeyError, msgpack.UnpackException):
            return False
        return isinstance(expires_at, (int, float)) and expires_at < time.time()


def sweep(store: SessionStore | None) -> int:
    """The janitor's pass over a directory store's index (Redis entries expire by their TTL)."""
    if not isinstance(store, DirectoryStore):
        return 0
    return _DirectoryEntries(store).sweep()
