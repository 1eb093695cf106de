"""SparseEngine's chain protocol on ``POST /v1/chat/completions``, beside ``prompt_cache_key``.

A chain is a session the server names. The client sends the whole conversation every time, as
with any chat request, plus:

- ``chain_id``: ``null`` starts a new chain (its session is ``chain-<random>``); an id the server
  gave continues that chain's session. The reply carries ``chain_id`` and ``chain_status``
  (``created`` or ``resumed``); a resumed chain's reused history is
  ``usage.prompt_tokens_details.cached_tokens``.
- ``chain_append_start`` (optional, with a ``chain_id``): the index in ``messages`` where the part
  the chain does not hold yet begins. ``messages[:chain_append_start]`` must be the chain's
  transcript (the messages so far and the replies as this server returned them; the message just
  before it is therefore an assistant reply) and at least one message must follow it. Without it
  the chain continues from the longest prefix of ``messages`` that is its transcript.

Errors (OpenAI's error JSON, the code in ``error.code``): 404 ``chain_not_found`` (no such chain
for this tenant: another tenant's id is answered exactly as an unknown one), 409
``chain_prefix_mismatch`` (the messages do not extend the chain's transcript: the client edited the
history), 409 ``chain_busy`` (a turn is running on the chain), 410 ``chain_gone`` (the chain was
ended here, by ``/v1/prefix_cache/delete_subtree`` or EndSession, or expired with nothing of it
stored). A SparseEngine client answers 410 by sending the whole prompt again with ``chain_id``
``null``, which starts a new chain. A malformed ``chain_id`` or ``chain_append_start`` is a 400
that leaves the chain as it was: both are checked before the chain is looked up.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Any

from engine.api import SessionBusy, SessionNotFound, TurnIndexMismatch
from sidecar.http.backend import SessionBackend
from sidecar.http.conversations import transcript_digest
from sidecar.http.errors import OpenAIError, invalid
from sidecar.session_ids import BadSessionId, check_id

NEW_CHAIN_PREFIX = "chain-"
CREATED = "created"
RESUMED = "resumed"


@dataclass(frozen=True)
class ChainRequest:
    chain_id: str | None
    """None: start a new chain."""
    append_start: int | None


@dataclass(frozen=True)
class ChainTarget:
    """The session a chain request runs on, and from which message on."""

    session_id: str
    key: str
    start: int
    turn_index: int | None
    status: str


def chain_request(body: dict[str, Any], roles: list[str]) -> ChainRequest | None:
    """The request's chain fields (None: it does not speak the protocol); 400 for malformed ones.
    ``roles``: the request's message roles."""
    if "chain_id" not in body:
        if body.get("chain_append_start") is not None:
            raise invalid("chain_append_start needs a chain_id", "chain_append_start")
        return None
    if body.get("prompt_cache_key") is not None:
        raise invalid("chain_id and prompt_cache_key are exclusive: a chain names its session", "chain_id")
    chain_id = body["chain_id"]
    if chain_id is not None:
        if not isinstance(chain_id, str):
            raise invalid("chain_id must be a string or null", "chain_id")
        try:
            check_id(chain_id, "chain_id")
        except BadSessionId as e:
            raise invalid(str(e)[:300], "chain_id") from None
    start = body.get("chain_append_start")
    if start is None:
        return ChainRequest(chain_id, None)
    if chain_id is None:
        raise invalid("chain_append_start needs the chain_id of an existing chain", "chain_append_start")
    if isinstance(start, bool) or not isinstance(start, int):
        raise invalid("chain_append_start must be an integer", "chain_append_start")
    if not 1 <= start < len(roles):
        raise invalid(
            f"chain_append_start must be between 1 and {len(roles) - 1} (at least one new message follows it)",
            "chain_append_start",
        )
    if roles[start - 1] != "assistant":
        raise invalid("the message before chain_append_start must be an assistant reply", "chain_append_start")
    return ChainRequest(chain_id, start)


def new_chain(backend: SessionBackend, tenant: str) -> ChainTarget:
    sid = NEW_CHAIN_PREFIX + secrets.token_urlsafe(18)
    return ChainTarget(sid, backend.key(tenant, sid), 0, None, CREATED)


async def resolve(
    backend: SessionBackend, tenant: str, req: ChainRequest, digests: list[bytes], roles: list[str]
) -> ChainTarget:
    """The session the request continues: a new chain, or the one ``req.chain_id`` names."""
    if req.chain_id is None:
        return new_chain(backend, tenant)
    key = backend.key(tenant, req.chain_id)
    s = await backend.find(key)
    if s is None:
        raise missing(backend, key, req.chain_id)
    k = _extends(s, req, digests, len(roles))
    if k is None:
        held = sum(1 for r in roles[: req.append_start or len(roles)] if r == "assistant")
        if held > s.turn_index:  # the chain went on elsewhere (another replica): the store's copy
            newer = await backend.find_newer(key, held)
            k = _extends(newer, req, digests, len(roles))
            s = newer if k is not None else s
    if k is None:
        raise OpenAIError(
            409,
            f"the messages do not extend chain {req.chain_id!r}'s history (it holds {s.turn_index} turns); "
            "send the whole prompt with chain_id null to start a new chain",
            "invalid_request_error",
            "messages",
            "chain_prefix_mismatch",
        )
    return ChainTarget(req.chain_id, key, k, s.turn_index, RESUMED)


def _extends(s, req: ChainRequest, digests: list[bytes], n: int) -> int | None:
    """Where the new messages begin when the session's transcript is a prefix of the request's."""
    if s is None:
        return None
    have = transcript_digest(s.front, s.turn_index)
    if have is None:
        return None
    if req.append_start is not None:
        return req.append_start if digests[req.append_start].hex() == have else None
    return next((k for k in range(n - 1, 0, -1) if digests[k].hex() == have), None)


def missing(backend: SessionBackend, key: str, chain_id: str) -> OpenAIError:
    """410 for a chain ended here, else 404 (the same body for another tenant's id as for none)."""
    if backend.was_ended(key):
        return OpenAIError(
            410,
            f"chain {chain_id!r} was ended or evicted; send the whole prompt with chain_id null",
            "invalid_request_error",
            "chain_id",
            "chain_gone",
        )
    return OpenAIError(404, f"no chain {chain_id!r}", "not_found_error", "chain_id", "chain_not_found")


def turn_error(e: BaseException, backend: SessionBackend, target: ChainTarget) -> OpenAIError | None:
    """A chain turn's failure in the protocol's terms (None: not one of its errors)."""
    if isinstance(e, SessionBusy):
        return OpenAIError(
            409, f"a turn is running on chain {target.session_id!r}", "conflict_error", "chain_id", "chain_busy"
        )
    if isinstance(e, TurnIndexMismatch):
        return OpenAIError(
            409,
            f"chain {target.session_id!r} moved on since this request was planned; send its current history",
            "invalid_request_error",
            "messages",
            "chain_prefix_mismatch",
        )
    if isinstance(e, SessionNotFound) and target.status == RESUMED:
        return missing(backend, target.key, target.session_id)
    return None


def reply_fields(target: ChainTarget) -> dict[str, str]:
    """What a chain reply (and each of its stream chunks) carries."""
    return {"chain_id": target.session_id, "chain_status": target.status}
