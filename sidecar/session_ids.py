"""Session ids and session keys: what a client may call a session, and the key the engine and the store see.

A client's session id (1-128 characters of ``[A-Za-z0-9._:@+=~-]``, not only dots: no braces, so
it cannot break the Redis hash tag, and no ``/``) is scoped by its tenant: the engine and the store
see ``<tenant>/<session id>``, or the bare id when auth is off. Tenants never see each other's
sessions.
"""

from __future__ import annotations

import re

SESSION_HEADER = "x-session-id"
"""The gRPC metadata key / HTTP header a client sends its session id in on every session call: a
proxy in front of a pool of replicas hashes on it to keep a session on the replica holding its KV
(deploy/k8s/overlays/pool). The HTTP front also takes it as Chat Completions' ``prompt_cache_key``."""
SESSION_ID_RE = re.compile(r"[A-Za-z0-9._:@+=~-]{1,128}")
MAX_ID_LEN = 128


class BadSessionId(ValueError):
    """A session id (or another id of the same form) a client may not use."""


def check_id(value: str, what: str = "session_id") -> str:
    if not value:
        raise BadSessionId(f"{what} is empty")
    if len(value) > MAX_ID_LEN:
        raise BadSessionId(f"{what} is {len(value)} characters long; at most {MAX_ID_LEN}")
    if not SESSION_ID_RE.fullmatch(value):
        raise BadSessionId(f"{what} {value!r} has characters outside [A-Za-z0-9._:@+=~-]")
    if not value.strip("."):
        raise BadSessionId(f"{what} {value!r} is only dots (it would name a folder such as . or ..)")
    return value


def scoped_key(tenant: str, session_id: str) -> str:
    """The engine / store key of a tenant's session."""
    check_id(session_id)
    return f"{tenant}/{session_id}" if tenant else session_id


__all__ = ["MAX_ID_LEN", "SESSION_ID_RE", "BadSessionId", "check_id", "scoped_key"]
