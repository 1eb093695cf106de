"""Session ids and session keys: what a client may call a session, and the key the engine and the store see.

A client's session id (1-128 characters of ``[A-Za-z0-9._:@+=~-]``, not only dots: no braces, so
it cannot break the Redis hash tag, and no ``/``) is scoped by its tenant: ``SessionKey(tenant, id)``.
The engine and the store see its stored form, ``<tenant>/<session id>``, or the bare id when auth is
off (``str(key)``); ``SessionKey.parse`` reads that form back. Tenants use the same alphabet (auth
checks them), so neither part holds a ``/`` and the split is unambiguous. Tenants never see each
other's sessions.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

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


@dataclass(frozen=True)
class SessionKey:
    """A tenant's session: the one join (``str``) and parse (``parse``) of the stored key form."""

    tenant: str
    """"" when auth is off."""
    id: str
    """The client's session id."""

    @classmethod
    def of(cls, tenant: str, session_id: str) -> SessionKey:
        """The key of ``tenant``'s session ``session_id`` (BadSessionId for an id a client may not use)."""
        return cls(tenant, check_id(session_id))

    @classmethod
    def parse(cls, stored: str) -> SessionKey:
        """The key whose stored form is ``stored``; BadSessionId unless both parts are well formed
        (a stored key names exactly one tenant's session)."""
        tenant, _, session_id = stored.rpartition("/")
        if tenant:
            check_id(tenant, "tenant")
        elif stored.startswith("/"):
            raise BadSessionId(f"session key {stored[:64]!r} has an empty tenant")
        return cls(tenant, check_id(session_id))

    @staticmethod
    def id_of(stored: str) -> str:
        """The session-id part of a stored key, for messages: unchecked, as a store's error may name
        any key it was given."""
        return stored.rpartition("/")[2]

    @staticmethod
    def tenant_of(stored: str) -> str:
        """The tenant part of a stored key ("" for a bare id), unchecked (keys reach the limits and
        the index only from ``SessionKey``)."""
        return stored.rpartition("/")[0]

    def __str__(self) -> str:
        return f"{self.tenant}/{self.id}" if self.tenant else self.id


def scoped_key(tenant: str, session_id: str) -> str:
    """The engine / store key of a tenant's session: ``str(SessionKey.of(tenant, session_id))``."""
    return str(SessionKey.of(tenant, session_id))


__all__ = ["MAX_ID_LEN", "SESSION_ID_RE", "BadSessionId", "SessionKey", "check_id", "scoped_key"]
