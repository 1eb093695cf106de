"""Request checks that bound what one request may cost the replica, applied before any work is done.

* ``loads_bounded``: JSON (tool schemas, tool-call arguments, the model's tool calls) nested at most
  ``MAX_JSON_DEPTH`` deep. Depth is measured by a linear scan before ``json.loads`` runs, so a
  5,000-deep array is refused (INVALID_ARGUMENT) instead of raising RecursionError.
* ``check_turn_bytes``: a turn's new text (message contents, names, tool-call arguments, tool
  schemas) in UTF-8 bytes, refused above the limit *before* it is tokenized or rendered (a 4 MB
  message cost seconds of tokenizing before the token limit refused it).
* ``request_digest`` / ``check_same_request``: a request_id names one request. A retry must carry
  the same content; another request under a recorded (or running) request_id is refused with
  FAILED_PRECONDITION instead of silently getting the old reply.
"""

from __future__ import annotations

import hashlib
import json
from typing import TYPE_CHECKING, Any

from engine.api import SessionError
from sidecar.turns.limits import TurnTooLarge

if TYPE_CHECKING:  # pragma: no cover
    from sidecar.sessions.record import Session

MAX_JSON_DEPTH = 64
BYTES_PER_TOKEN = 16
"""The default byte limit of a turn's text is this many bytes per token of the model's context."""


class JsonTooDeep(ValueError):
    """A JSON document nested deeper than allowed."""


class RequestMismatch(SessionError):
    """A request_id reused for a different request (FAILED_PRECONDITION)."""


def json_depth(text: str) -> int:
    """The deepest nesting of arrays and objects in ``text`` (strings skipped), without recursion."""
    depth = deepest = 0
    in_string = escaped = False
    for ch in text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif ch in "]}":
            depth -= 1
    return deepest


def loads_bounded(text: str, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """``json.loads`` of a document nested at most ``max_depth`` deep (JsonTooDeep otherwise)."""
    if "[" in text or "{" in text:
        d = json_depth(text)
        if d > max_depth:
            raise JsonTooDeep(f"JSON nested {d} levels deep; at most {max_depth}")
    try:
        return json.loads(text)
    except RecursionError:  # belt and braces: json_depth should have caught it
        raise JsonTooDeep(f"JSON nested too deep; at most {max_depth}") from None


def turn_text_bytes(request) -> int:
    """UTF-8 bytes of the text a Turn asks the sidecar to render and tokenize."""
    n = 0
    for m in request.messages:
        n += len(m.content.encode("utf-8", "surrogatepass")) + len(m.name) + len(m.tool_call_id)
        for c in m.tool_calls:
            n += len(c.name) + len(c.arguments_json.encode("utf-8", "surrogatepass"))
    for t in request.tools:
        n += (
            len(t.name)
            + len(t.description.encode("utf-8", "surrogatepass"))
            + len(t.parameters_json.encode("utf-8", "surrogatepass"))
        )
    return n


def check_turn_bytes(request, max_bytes: int) -> None:
    """Refuse a Turn whose text is above ``max_bytes`` (TurnTooLarge: INVALID_ARGUMENT)."""
    n = turn_text_bytes(request)
    if n > max_bytes:
        raise TurnTooLarge(
            f"the turn's messages and tools are {n} bytes; at most {max_bytes} "
            f"(the model's context holds {max_bytes // BYTES_PER_TOKEN} tokens)"
        )


def request_digest(request) -> str:
    """A digest of everything a Turn asks for except its ids and its precondition (a retry must match it)."""
    copy = type(request)()
    copy.CopyFrom(request)
    copy.session_id = ""
    copy.request_id = ""
    copy.ClearField("expected_turn_index")
    return hashlib.sha256(copy.SerializeToString(deterministic=True)).hexdigest()


def check_same_request(s: "Session", request_id: str, digest: str) -> None:
    """Raise RequestMismatch when ``request_id`` is recorded (or running) on ``s`` for other content."""
    known = s.request_digests.get(request_id)
    if known is None and s.running is not None and s.running.request_id == request_id:
        known = s.running.digest
    if known and known != digest:
        raise RequestMismatch(
            f"request_id {request_id!r} was already used for a different request on this "
            f"session; use a new request_id for a new request"
        )
