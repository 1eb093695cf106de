"""DirectoryStore: the embedded default session store, one folder per session in a local directory.

``<root>/<folder>/meta`` holds the same hash fields as Redis' meta, as one msgpack map, and
``kv.<version>.<i>`` files lie beside it, each written to a temporary file and renamed into place;
commits hold an ``flock`` on the session's folder. ``<folder>`` is ``s-`` plus the base32 SHA-256 of
the key (``folder_name``): whatever bytes a tenant or session id holds (``..``, ``/``, NUL, 10 KB),
its folder is one fixed-length name directly inside the root. Deleting a session removes only the
files the store writes (``meta``, ``fence``, ``.lock``, ``kv.*`` and its temporary files), then the
folder if it is empty; ``sweep`` does the same for expired sessions.
"""

from __future__ import annotations

import base64
import fcntl
import hashlib
import os
import re
import secrets
import time
import urllib.parse
from pathlib import Path
from typing import Any

import msgpack

from sidecar.store.base import SessionStore
from sidecar.store.errors import GenerationConflict, StoreError, StoreUnavailable


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

    atomic_write = _atomic_write  # public: for the transcript index's files (sidecar/store/transcript_index.py)

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
