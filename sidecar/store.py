"""SessionStore: where session snapshots live so that any replica can resume a session.

Two implementations share one format:

* ``RedisStore`` (production, redis-py). A session ``<key>`` is
  ``<prefix>:{<key>}:meta``, a hash, plus binary chunks ``<prefix>:{<key>}:kv:<version>:<i>``.
  The braces are a Redis Cluster hash tag: a session's keys live on one shard. ``<version>`` is
  the generation plus a per-write nonce (``12.3f9a01c2``), so two replicas racing on the same
  generation never overwrite each other's chunks.
* ``DirectoryStore`` (the embedded default): ``<root>/<folder>/meta`` (the same hash fields,
  as one msgpack map) and ``kv.<version>.<i>`` files beside it, each written to a temporary file
  and renamed into place; commits hold an ``flock`` on the session's folder. ``<folder>`` is
  ``s-`` plus the base32 SHA-256 of the key: whatever bytes a tenant or session id holds (``..``,
  ``/``, NUL, 10 KB), its folder is one fixed-length name directly inside the root. Deleting a
  session removes only the files the store writes (``meta``, ``fence``, ``.lock``, ``kv.*`` and
  its temporary files), then the folder if it is empty.

A write puts the chunks first, then commits the meta on the *expected generation* (the one the
writer loaded or last committed; none for a new session): Redis checks it in a Lua script, the
directory store under its lock. Readers trust only the chunks the committed meta lists, and each
chunk is verified against the checksum the meta records for it (``Checksum``, SHA-256; a keyed
HMAC replaces it when a key is configured, and the meta is then signed too: sidecar/integrity.py). Every key has
a TTL (the directory store records ``expires_at`` and treats expired sessions as gone). Values
are raw bytes, ASCII numbers or msgpack; no pickle anywhere.

Freshness. Beside the meta, each session has a *fence*: the highest generation ever committed
for it (``<prefix>:{<key>}:fence`` in Redis, ``fence`` in the session's folder), raised in the
same atomic step as each commit and never lowered (signed with the snapshot HMAC key when one is
configured, and bound to the session key). A meta older than its fence (an older, validly signed
record put back, a replica promoted from a lagging copy, a backup restored over newer data) is
refused with ``SnapshotRolledBack``: it is never served as the current session. A commit never
writes a generation below the fence.

The meta hash fields: the session record (what ``ChainCache.snapshot`` produces minus the KV
state, see ``engine.chain.KV_STATE_KEYS``): ``session_id``, ``turn_index``, ``generation``,
``tokens`` (the token history, uint32 little-endian), ``digest``, ``fingerprint``, ``method``,
``spans``, ``prune_log``, ... ; plus ``format``, ``kv`` (the chunk manifest: count, sizes,
checksum algorithm, per-chunk checksums), ``app`` (the sidecar's own metadata) and timestamps.
The KV chunks are a ``SessionSnapshot`` byte string (engine/cache/snapshot.py) cut into pieces.
"""

from __future__ import annotations

import base64
import fcntl
import hashlib
import hmac
import math
import os
import re
import secrets
import time
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack

from sidecar.store_errors import (
    GenerationConflict,
    SnapshotRejected,
    SnapshotRolledBack,
    StoreError,  # noqa: F401
    StoreUnavailable,
)

FORMAT = b"chainkv-session/1"
DEFAULT_TTL_S = 7 * 24 * 3600
DEFAULT_CHUNK_BYTES = 4 * 2**20

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


def _fence_bytes(key: str, generation: int) -> bytes:
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
        """``hmac_keys``: a ``sidecar.integrity.SnapshotKeys``; the meta is then signed and checked,
        and the chunks carry HMACs (see sidecar/integrity.py)."""
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
        return f"{int(generation)}.{self.hmac_keys.mac(_fence_bytes(key, generation))}".encode()

    def parse_fence(self, key: str, raw: bytes | None) -> int | None:
        """The generation a stored fence holds (None: none). A forged or malformed fence raises StoreError."""
        if not raw:
            return None
        text = raw.decode("ascii", "replace")
        gen, _, tag = text.partition(".")
        if not gen.isdigit():
            raise StoreError(f"the freshness fence of {key.split('/')[-1]!r} is malformed")
        if self.hmac_keys is not None:
            if not tag or not self.hmac_keys.verify(_fence_bytes(key, int(gen)), tag):
                raise SnapshotRejected(
                    f"the freshness fence of {key.split('/')[-1]!r} fails its HMAC; refusing the session"
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


# --- Redis ------------------------------------------------------------------------------------------
_COMMIT_LUA = """
-- KEYS[1]: the session's meta hash; KEYS[2]: its fence. ARGV[1]: the generation the writer expects
-- to replace ('' when the session must be new). ARGV[2]: the TTL in seconds. ARGV[3]: the new
-- generation; ARGV[4]: its fence value. ARGV[5..]: field, value pairs.
local cur = redis.call('HGET', KEYS[1], 'generation')
if (ARGV[1] == '' and cur) or (ARGV[1] ~= '' and cur ~= ARGV[1]) then
  return {0, cur or ''}
end
local fence = tonumber(string.match(redis.call('GET', KEYS[2]) or '', '^(%d+)') or '-1')
local gen = tonumber(ARGV[3])
if gen < fence then
  return {2, tostring(fence)}
end
local old = redis.call('HGET', KEYS[1], 'kv') or ''
redis.call('DEL', KEYS[1])
redis.call('HSET', KEYS[1], unpack(ARGV, 5))
redis.call('EXPIRE', KEYS[1], ARGV[2])
if gen > fence then
  redis.call('SET', KEYS[2], ARGV[4], 'EX', ARGV[2])
else
  redis.call('EXPIRE', KEYS[2], ARGV[2])
end
return {1, old}
"""


class RedisStore(SessionStore):
    kind = "redis"

    def __init__(self, url: str, prefix: str = "chainkv", client: Any = None, **kw: Any):
        super().__init__(**kw)
        import redis

        self._redis = redis
        self.url = url
        self.prefix = prefix
        self.client = client or redis.Redis.from_url(
            url, socket_connect_timeout=2.0, socket_timeout=10.0, health_check_interval=30
        )
        self._commit_script = self.client.register_script(_COMMIT_LUA)

    def describe(self) -> str:
        u = urllib.parse.urlsplit(self.url)
        return f"redis {u.hostname or u.path}:{u.port or ''}".rstrip(":")

    def _ttl(self) -> int:
        return max(1, math.ceil(self.ttl_s))

    ttl_seconds = _ttl  # public: the TTL other keys of this store get (sidecar/transcript_index.py)

    def meta_key(self, key: str) -> str:
        return f"{self.prefix}:{{{key}}}:meta"

    def fence_key(self, key: str) -> str:
        return f"{self.prefix}:{{{key}}}:fence"

    def chunk_key(self, key: str, version: str, i: int) -> str:
        return f"{self.prefix}:{{{key}}}:kv:{version}:{i}"

    def _call(self, fn, *args, **kw):
        r = self._redis
        try:
            return fn(*args, **kw)
        except (r.exceptions.ConnectionError, r.exceptions.TimeoutError) as e:
            raise StoreUnavailable(f"redis is unreachable: {e}") from None
        except r.exceptions.RedisError as e:
            raise StoreError(f"redis: {e}") from None

    call = _call  # public: a command of another module with this store's error mapping

    def ping(self) -> None:
        self._call(self.client.ping)

    def close(self) -> None:
        self.client.close()

    def _write_chunks(self, key: str, version: str, chunks: list[bytes]) -> None:
        def write():
            pipe = self.client.pipeline(transaction=False)
            for i, c in enumerate(chunks):
                pipe.set(self.chunk_key(key, version, i), c, ex=self._ttl())
            pipe.execute()

        self._call(write)

    def _commit(self, key: str, fields: dict[str, bytes], expected: int | None, fence: bytes) -> dict[str, Any] | None:
        args: list[bytes | str] = [
            "" if expected is None else str(expected),
            str(self._ttl()),
            fields["generation"],
            fence,
        ]
        for k, v in fields.items():
            args += [k, v]
        ok, old = self._call(self._commit_script, keys=[self.meta_key(key), self.fence_key(key)], args=args)
        if ok == 2:
            raise GenerationConflict(key, expected, int(old), fenced=True)
        if not ok:
            raise GenerationConflict(key, expected, int(old) if old else None)
        return msgpack.unpackb(old, raw=False) if old else None

    def _read_meta(self, key: str) -> dict | None:
        return self._call(self.client.hgetall, self.meta_key(key)) or None

    def _read_fence(self, key: str) -> bytes | None:
        return self._call(self.client.get, self.fence_key(key))

    def _read_chunks(self, key: str, version: str, n: int) -> list[bytes | None]:
        return self._call(self.client.mget, [self.chunk_key(key, version, i) for i in range(n)])

    def _delete_chunks(self, key: str, version: str, n: int) -> None:
        if n:
            self._call(self.client.unlink, *[self.chunk_key(key, version, i) for i in range(n)])

    def delete(self, key: str) -> bool:
        fields = self._read_meta(key)
        if not fields:
            return False
        try:
            _, manifest, _ = decode_fields(fields)
            self._delete_chunks(key, manifest["version"], manifest.get("chunks", 0))
        except StoreError:
            pass
        return bool(self._call(self.client.unlink, self.meta_key(key), self.fence_key(key)))


# --- a local directory --------------------------------------------------------------------------------
class DirectoryStore(SessionStore):
    kind = "directory"

    def __init__(self, root: str | Path, **kw: Any):
        super().__init__(**kw)
        self.root = Path(root).expanduser()
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise StoreUnavailable(f"cannot create the session folder {self.root}: {e}") from None
        self.migrated = self._migrate_quoted_folders()

    def _migrate_quoted_folders(self) -> int:
        """Move sessions an earlier version stored under ``<root>/<quoted key>`` to their hashed folder
        (their checksums and HMACs bind the key, not the path, so they stay valid). Returns how many."""
        moved = 0
        try:
            entries = list(self.root.iterdir())
        except OSError:
            return 0
        for d in entries:
            if OWN_FOLDER_RE.fullmatch(d.name) or d.is_symlink() or not d.is_dir() or not (d / "meta").is_file():
                continue
            key = urllib.parse.unquote(d.name)
            if urllib.parse.quote(key, safe="") != d.name:
                continue  # not a name this store ever made
            target = self.folder(key)
            try:
                if not target.exists():
                    os.rename(d, target)
                    moved += 1
            except OSError:
                continue
        return moved

    def describe(self) -> str:
        return f"directory {self.root}"

    def folder(self, key: str) -> Path:
        """The session's folder: a fixed-length name derived from the key's bytes, directly in the root."""
        return self.root / folder_name(key)

    def ping(self) -> None:
        if not os.access(self.root, os.W_OK):
            raise StoreUnavailable(f"the session folder {self.root} is not writable")

    def _atomic_write(self, path: Path, data: bytes) -> None:
        tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
        try:
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except OSError as e:
            tmp.unlink(missing_ok=True)
            raise StoreUnavailable(f"cannot write {path}: {e}") from None

    atomic_write = _atomic_write  # public: for the transcript index's files (sidecar/transcript_index.py)

    def _mkdir(self, key: str) -> Path:
        d = self.folder(key)
        try:
            d.mkdir(exist_ok=True)
        except OSError as e:
            raise StoreUnavailable(f"cannot create {d}: {e}") from None
        return d

    def _write_chunks(self, key: str, version: str, chunks: list[bytes]) -> None:
        d = self._mkdir(key)
        for i, c in enumerate(chunks):
            self._atomic_write(d / f"kv.{version}.{i}", c)

    def _lock(self, key: str):
        return _FileLock(self._mkdir(key) / ".lock")

    def _commit(self, key: str, fields: dict[str, bytes], expected: int | None, fence: bytes) -> dict[str, Any] | None:
        d = self.folder(key)
        with self._lock(key):
            current = self._read_meta(key)
            found = int(current[b"generation"]) if current and self._alive(current) else None
            if found != expected:
                raise GenerationConflict(key, expected, found)
            raw = self._read_fence(key)
            have = int(raw.split(b".", 1)[0]) if raw and raw.split(b".", 1)[0].isdigit() else -1
            gen = int(fields["generation"])
            if gen < have:
                raise GenerationConflict(key, expected, have, fenced=True)
            if gen > have:
                self._atomic_write(d / "fence", fence)
            self._atomic_write(d / "meta", msgpack.packb({k.encode(): v for k, v in fields.items()}, use_bin_type=True))
            return msgpack.unpackb(current[b"kv"], raw=False) if current else None

    @staticmethod
    def _alive(fields: dict) -> bool:
        return float(fields.get(b"expires_at", b"inf")) >= time.time()

    def _read_meta(self, key: str) -> dict | None:
        path = self.folder(key) / "meta"
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as e:
            raise StoreUnavailable(f"cannot read {path}: {e}") from None
        try:
            return msgpack.unpackb(data, raw=True)
        except msgpack.UnpackException as e:
            raise StoreError(f"{path} is corrupt: {e}") from None

    def _read_fence(self, key: str) -> bytes | None:
        path = self.folder(key) / "fence"
        try:
            return path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as e:
            raise StoreUnavailable(f"cannot read {path}: {e}") from None

    def _read_chunks(self, key: str, version: str, n: int) -> list[bytes | None]:
        out: list[bytes | None] = []
        for i in range(n):
            try:
                out.append((self.folder(key) / f"kv.{version}.{i}").read_bytes())
            except FileNotFoundError:
                out.append(None)
        return out

    def _delete_chunks(self, key: str, version: str, n: int) -> None:
        for i in range(n):
            (self.folder(key) / f"kv.{version}.{i}").unlink(missing_ok=True)

    def delete(self, key: str) -> bool:
        d = self.folder(key)
        if not d.is_dir():
            return False
        with self._lock(key):
            existed = (d / "meta").exists()
            _remove_own_files(d)
        _remove_if_empty(d)
        return existed

    def sweep(self) -> int:
        """Delete expired sessions; returns how many."""
        n = 0
        for d in self.root.iterdir():
            if not OWN_FOLDER_RE.fullmatch(d.name) or d.is_symlink() or not d.is_dir():
                continue  # not a folder this store made
            meta = d / "meta"
            try:
                fields = msgpack.unpackb(meta.read_bytes(), raw=True)
            except (OSError, msgpack.UnpackException):
                continue
            if not self._alive(fields):
                with _FileLock(d / ".lock"):
                    _remove_own_files(d)
                _remove_if_empty(d)
                n += 1
        return n


OWN_FOLDER_RE = re.compile(r"s-[a-z2-7]{52}")
OWN_FILE_RE = re.compile(
    r"meta|fence|\.lock|kv\.[0-9]+\.[0-9a-f]+\.[0-9]+|\.(meta|fence|kv\.[0-9]+\.[0-9a-f]+\.[0-9]+)\.[0-9a-f]+\.tmp"
)


def folder_name(key: str) -> str:
    """``s-`` + the unpadded base32 of SHA-256(key): 54 characters of ``[a-z2-7-]`` for any key."""
    digest = hashlib.sha256(b"chainkv-session-folder/1\0" + key.encode("utf-8", "surrogatepass")).digest()
    return "s-" + base64.b32encode(digest).decode().rstrip("=").lower()


def _remove_own_files(d: Path) -> None:
    """Unlink the files a DirectoryStore writes in ``d`` (never anything else, never following links out)."""
    for p in d.iterdir():
        if OWN_FILE_RE.fullmatch(p.name) and (p.is_symlink() or p.is_file()):
            p.unlink(missing_ok=True)


def _remove_if_empty(d: Path) -> None:
    try:
        d.rmdir()
    except OSError:
        pass  # a writer put a file there meanwhile, or something that is not ours


class _FileLock:
    def __init__(self, path: Path):
        self.path = path

    def __enter__(self):
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        fcntl.flock(self.fd, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc):
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        os.close(self.fd)


def default_store_dir() -> Path:
    from engine.model.loader import cache_root

    return cache_root() / "sessions"


def open_store(url: str | None, **kw: Any) -> SessionStore | None:
    """``redis://host:port/db`` (or ``rediss://``, ``unix://``), ``file:///path`` (or a plain path),
    ``none`` (no store: sessions live on this replica only); None means the default directory."""
    if url is None or url == "":
        return DirectoryStore(default_store_dir(), **kw)
    if url == "none":
        return None
    scheme = urllib.parse.urlsplit(url).scheme
    if scheme in ("redis", "rediss", "unix"):
        return RedisStore(url, **kw)
    if scheme == "file":
        u = urllib.parse.urlsplit(url)
        path = urllib.parse.unquote((u.netloc or "") + u.path)
        return DirectoryStore(path, **kw)
    if scheme == "":
        return DirectoryStore(url, **kw)
    raise ValueError(f"unknown store {url!r}: use redis://..., file://..., a folder path or none")
