"""The session store: where session snapshots live so that any replica can resume a session.

Two implementations share one format:

* ``RedisStore`` (production, redis-py; redis_store.py): a meta hash per session plus binary KV
  chunks, committed by a Lua script, every key under a Redis Cluster hash tag and with a TTL.
* ``DirectoryStore`` (the embedded default; directory_store.py): one folder per session, named by
  a hash of the key, holding the same fields as one msgpack file plus the chunks, written by
  temp-file + rename under an ``flock``.

The package's modules: record.py is the stored format (the meta fields and their codec,
``StoredSession``, the per-chunk ``Checksum``, the fence's signed bytes); base.py is
``SessionStore``, the save / load / delete protocol and the freshness fence that refuses a
rolled-back session; redis_store.py and directory_store.py the two stores; this module picks one
from a URL (``open_store``). The errors are in sidecar/store/errors.py.
"""

from __future__ import annotations

import urllib.parse
from pathlib import Path
from typing import Any

from sidecar.store.base import DEFAULT_CHUNK_BYTES, DEFAULT_TTL_S, SessionStore
from sidecar.store.directory_store import OWN_FILE_RE, OWN_FOLDER_RE, DirectoryStore, folder_name
from sidecar.store.errors import (
    GenerationConflict,
    SnapshotRejected,
    SnapshotRolledBack,
    StoreError,
    StoreUnavailable,
)
from sidecar.store.record import FORMAT, Checksum, StoredSession, decode_fields, encode_fields, fence_bytes
from sidecar.store.redis_store import RedisStore

__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "DEFAULT_TTL_S",
    "FORMAT",
    "OWN_FILE_RE",
    "OWN_FOLDER_RE",
    "Checksum",
    "DirectoryStore",
    "GenerationConflict",
    "RedisStore",
    "SessionStore",
    "SnapshotRejected",
    "SnapshotRolledBack",
    "StoreError",
    "StoreUnavailable",
    "StoredSession",
    "decode_fields",
    "default_store_dir",
    "encode_fields",
    "fence_bytes",
    "folder_name",
    "open_store",
]


def default_store_dir() -> Path:
    from engine.api import cache_root

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
