"""RedisStore: the production session store (redis-py).

A session ``<key>`` is ``<prefix>:{<key>}:meta``, a hash, plus binary chunks
``<prefix>:{<key>}:kv:<version>:<i>``. The braces are a Redis Cluster hash tag: a session's keys
live on one shard. ``<version>`` is the generation plus a per-write nonce (``12.3f9a01c2``), so two
replicas racing on the same generation never overwrite each other's chunks. The commit (the
expected-generation check, the meta and the fence) is one Lua script; the fence is
``<prefix>:{<key>}:fence``.
"""

from __future__ import annotations

import math
import urllib.parse
from typing import Any

import msgpack

from sidecar.store.base import SessionStore
from sidecar.store.errors import GenerationConflict, StoreError, StoreUnavailable
from sidecar.store.record import decode_fields

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

    ttl_seconds = _ttl  # public: the TTL other keys of this store get (sidecar/store/transcript_index.py)

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
