"""Optional bearer-token auth: ``authorization: Bearer <token>`` gRPC metadata -> a tenant.

With no tokens configured every caller is the anonymous tenant ``""`` (auth off). With tokens,
every Sidecar call must carry a known token (UNAUTHENTICATED otherwise); the token's tenant
scopes the caller's session ids (``sidecar.session_ids.scoped_key``). The health and reflection
services stay open, so probes need no token.

A token file has one ``TOKEN TENANT`` pair per line (``#`` comments and blank lines ignored);
tenants use the session-id alphabet. Tokens are compared in constant time.
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

from sidecar.session_ids import BadSessionId, check_id
from sidecar.settings import setting


class Unauthenticated(PermissionError):
    pass


class Authenticator:
    def __init__(self, tokens: dict[str, str] | None = None):
        self.tokens = dict(tokens or {})
        for token, tenant in self.tokens.items():
            if not token:
                raise ValueError("an auth token must not be empty")
            try:
                check_id(tenant, "tenant")
            except BadSessionId as e:
                raise ValueError(str(e)) from None

    @property
    def enabled(self) -> bool:
        return bool(self.tokens)

    @classmethod
    def from_args(cls, pairs: Iterable[str] = (), files: Iterable[str] = ()) -> "Authenticator":
        """From ``TOKEN=TENANT`` pairs and token files."""
        tokens: dict[str, str] = {}
        for item in pairs:
            token, sep, tenant = item.partition("=")
            if not sep:
                raise ValueError(f"--auth-token expects TOKEN=TENANT, got {item!r}")
            tokens[token.strip()] = tenant.strip()
        for path in files:
            for n, line in enumerate(Path(path).read_text().splitlines(), 1):
                line = line.split("#", 1)[0].strip()
                if not line:
                    continue
                parts = line.split()
                if len(parts) != 2:
                    raise ValueError(f"{path}:{n}: expected 'TOKEN TENANT'")
                tokens[parts[0]] = parts[1]
        return cls(tokens)

    def tenant(self, metadata: Iterable[tuple[str, str | bytes]] | None) -> str:
        if not self.tokens:
            return ""
        header = None
        for key, value in metadata or ():
            if key.lower() == "authorization":
                header = value.decode() if isinstance(value, bytes) else value
                break
        if header is None:
            raise Unauthenticated("missing 'authorization: Bearer <token>' metadata")
        scheme, _, token = header.strip().partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise Unauthenticated("the authorization metadata must be 'Bearer <token>'")
        token = token.strip()
        found = None
        for known, tenant in self.tokens.items():
            if hmac.compare_digest(known.encode(), token.encode()):
                found = tenant
        if found is None:
            raise Unauthenticated("unknown bearer token")
        return found


@dataclass
class AuthSettings:
    """The auth settings of ``chainkv serve`` (``ServerOptions.auth`` is built from them)."""

    auth_token: list[str] = setting(
        [],
        "accept 'authorization: Bearer TOKEN' as TENANT (repeatable); with none, auth is off",
        metavar="TOKEN=TENANT",
    )
    auth_file: list[str] = setting([], "a file of 'TOKEN TENANT' lines", metavar="FILE")

    def authenticator(self) -> Authenticator:
        return Authenticator.from_args(self.auth_token, self.auth_file)
