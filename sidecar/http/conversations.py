"""Finding the session of a stateless Chat Completions request.

A chat request carries its whole conversation. Its session is the one whose transcript (every
message so far, the replies as this server returned them) is the longest prefix of the request's
messages: only the messages after that prefix are rendered and prefilled. Transcripts are compared
by chained digests: ``d_0`` = SHA-256 of the tenant, the tools and the session's method, ``d_k`` = SHA-256 of
``d_{k-1}`` and the k-th message in canonical form (role, text, name, tool calls by name and
arguments parsed as JSON; tool-call ids and whitespace in arguments do not count, since
frameworks rewrite them). A session's current digest is kept with it (``Session.front``, so it
travels with its snapshot), in this replica's ``TranscriptIndex`` (digest -> session key) and,
once the session's snapshot is committed, in the store's index (sidecar/store/transcript_index.py), which
every replica sharing the store reads when its own index knows no prefix as long (both hold one
entry per session, its latest).

With ``prompt_cache_key`` (or an ``X-Session-Id`` header) the client names the session: it is
continued when its transcript is a prefix of the request, and restarted (ended, then begun again
from the whole request) when the client changed the history.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from collections import OrderedDict
from typing import Any

FRONT_KEY = "chat_transcript"
"""``Session.front`` entry: the digest of the session's transcript after its last turn."""
FRONT_TURN_KEY = "chat_transcript_turn"
"""``Session.front`` entry: the turn index the digest was recorded at. A session whose turn index is
another (a turn ran that did not record its transcript) matches no transcript."""
_SAFE_ID = re.compile(r"[A-Za-z0-9._:@+=~-]{1,128}")


def transcript_digest(front: dict, turn_index: int) -> str | None:
    """The session's transcript digest (hex) when it is the one of its current turn, else None."""
    turn = front.get(FRONT_TURN_KEY)
    if turn is not None and turn != turn_index:
        return None
    digest = front.get(FRONT_KEY)
    return digest if isinstance(digest, str) else None


def canonical(message: dict[str, Any]) -> list:
    """A message as it counts for matching (``message`` as ``protocol.message_dict`` makes them)."""
    calls = []
    for c in message.get("tool_calls") or []:
        args = c.get("arguments", {})
        calls.append([c.get("name", ""), json.dumps(args, sort_keys=True, separators=(",", ":"))])
    return [message["role"], (message.get("content") or "").strip(), message.get("name") or "", calls]


def seed_digest(tenant: str, tools_digest: str, method: str) -> bytes:
    """The digest of an empty transcript: per tenant (tenants never match each other's sessions),
    per tool set and per method."""
    return hashlib.sha256(json.dumps(["chainkv-chat-v1", tenant, tools_digest, method]).encode()).digest()


def chain(previous: bytes, message: dict[str, Any]) -> bytes:
    return hashlib.sha256(previous + json.dumps(canonical(message), ensure_ascii=False).encode()).digest()


def prefix_digests(seed: bytes, messages: list[dict[str, Any]]) -> list[bytes]:
    """``out[k]``: the digest of ``messages[:k]`` (``out[0]`` is the seed)."""
    out = [seed]
    for m in messages:
        out.append(chain(out[-1], m))
    return out


def session_id_for_key(key: str) -> str:
    """A session id for a client's prompt_cache_key (hashed when it is not a valid id)."""
    if _SAFE_ID.fullmatch(key) and not key.startswith(("chat-", "resp-")):
        return "pck-" + key if len("pck-" + key) <= 128 else "pck-" + hashlib.sha256(key.encode()).hexdigest()
    return "pck-" + hashlib.sha256(key.encode()).hexdigest()


class TranscriptIndex:
    """digest -> session key on this replica (bounded, least recently used dropped first)."""

    def __init__(self, capacity: int = 65536):
        self.capacity = capacity
        self._by_digest: OrderedDict[bytes, str] = OrderedDict()
        self._by_key: dict[str, bytes] = {}
        self._lock = threading.Lock()

    def put(self, key: str, digest: bytes) -> None:
        with self._lock:
            old = self._by_key.pop(key, None)
            if old is not None:
                self._by_digest.pop(old, None)
            self._by_digest[digest] = key
            self._by_key[key] = digest
            while len(self._by_digest) > self.capacity:
                d, k = self._by_digest.popitem(last=False)
                self._by_key.pop(k, None)

    def get(self, digest: bytes) -> str | None:
        with self._lock:
            key = self._by_digest.get(digest)
            if key is not None:
                self._by_digest.move_to_end(digest)
            return key

    def drop(self, key: str) -> None:
        with self._lock:
            d = self._by_key.pop(key, None)
            if d is not None:
                self._by_digest.pop(d, None)

    def __len__(self) -> int:
        return len(self._by_digest)
