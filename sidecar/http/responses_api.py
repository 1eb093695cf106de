"""``POST /v1/responses``, ``GET`` / ``DELETE /v1/responses/{id}`` on chain sessions.

Every response belongs to a session. A response id names its session
(``resp_<base64url(session id)>.<nonce>``), so it resolves on any replica: the session is loaded
from the store when it is not here, and its stored responses (the last ``MAX_STORED``, kept in
``Session.front``, written with its snapshot) answer ``GET``. ``previous_response_id`` continues
the session when it names the session's latest response (only the new input items are prefilled);
``conversation`` names the session itself (created on first use). ``store: false`` keeps no record,
and a response with neither ``previous_response_id`` nor ``conversation`` then ends its session.
Function tools and ``function_call_output`` items map onto the session's tools and tool messages;
``text.format`` json_schema and forced ``tool_choice`` decode under a grammar. This module parses
the request and serves ``GET`` / ``DELETE``; the output items, the streamed events (every one
validated against the ``openai`` package's event types) and the stored response record are built
by ``ResponseRun`` (sidecar/http/response_events.py).
"""

from __future__ import annotations

import base64
import binascii
import json
import uuid
from dataclasses import dataclass
from typing import Any

from sidecar.http import requests as rq
from sidecar.http.backend import SessionBackend, prepend
from sidecar.http.errors import OpenAIError, invalid
from sidecar.http.response_events import ResponseRun
from sidecar.session_ids import BadSessionId, check_id
from sidecar.turns.request import Message, Tool, ToolCall, ToolChoice, TurnRequest


def response_id(session_id: str) -> str:
    sid = base64.urlsafe_b64encode(session_id.encode()).decode().rstrip("=")
    return f"resp_{sid}.{uuid.uuid4().hex[:16]}"


def session_of(resp_id: Any, param: str = "response_id") -> str:
    """The session id a response id names (404 for anything that is not one); ``param``: the request
    field that gave it."""
    try:
        if not isinstance(resp_id, str) or not resp_id.startswith("resp_") or "." not in resp_id or len(resp_id) > 400:
            raise ValueError
        b64 = resp_id[5:].rsplit(".", 1)[0]
        sid = base64.urlsafe_b64decode(b64 + "=" * (-len(b64) % 4)).decode()
        return check_id(sid)
    except (ValueError, binascii.Error, UnicodeDecodeError, BadSessionId):
        raise OpenAIError(
            404,
            f"No response found with id {str(resp_id)[:200]!r}",
            "invalid_request_error",
            param,
            "response_not_found",
        ) from None


def parse_input(raw: Any, instructions: str | None) -> list[Message]:
    items = [{"role": "user", "content": raw}] if isinstance(raw, str) else raw
    if not isinstance(items, list) or not items or len(items) > 4096:
        raise invalid("input must be a string or a non-empty list of at most 4096 items", "input")
    out: list[Message] = [Message(role="system", content=instructions)] if instructions else []
    for i, it in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(it, dict):
            raise invalid(f"{where} must be an object", "input")
        kind = it.get("type", "message")
        if kind == "message":
            role = {"developer": "system"}.get(it.get("role"), it.get("role"))
            if role not in ("system", "user", "assistant"):
                raise invalid(f"{where}.role must be user, system, developer or assistant", "input")
            text = rq.text_content(it.get("content"), where, ("input_text", "output_text", "text", "refusal"))
            out.append(Message(role=role, content=text))
        elif kind == "function_call":
            name, call_id = it.get("name"), it.get("call_id", "")
            if not isinstance(name, str) or not name or not isinstance(call_id, str):
                raise invalid(f"{where}: a function_call needs a name and a call_id", "input")
            call = ToolCall(
                id=call_id[:256], name=name[:128], arguments_json=rq.arguments_object(it.get("arguments", "{}"), where)
            )
            if out and out[-1].role == "assistant":
                out[-1].tool_calls.append(call)
            else:
                out.append(Message(role="assistant", tool_calls=[call]))
        elif kind == "function_call_output":
            call_id, output = it.get("call_id", ""), it.get("output")
            if not isinstance(call_id, str):
                raise invalid(f"{where}.call_id must be a string", "input")
            text = output if isinstance(output, str) else rq.text_content(output, where, ("input_text", "output_text"))
            out.append(Message(role="tool", content=text, tool_call_id=call_id[:256]))
        else:
            raise invalid(f"{where}: input items of type {str(kind)[:50]!r} are not supported", "input")
    return out


class Responses:
    def __init__(self, backend: SessionBackend):
        self.backend = backend

    # --- create -------------------------------------------------------------------------------------
    async def create(self, body: dict, authorization: str | None):
        """Check the request (in this order: the top-level options, the turn's fields, the session it
        continues), then run its turn: streamed as server-sent events, or whole."""
        b = self.backend
        tenant = b.tenant(authorization)
        opts = _options(body, b.model_name)
        req = _turn_fields(body, opts)
        target = await self._target(tenant, body)
        req.session_id = target.session_id
        req.expected_turn_index = target.expected_turn_index
        req.messages = parse_input(body.get("input"), opts.instructions if target.new else None)
        run = ResponseRun(
            b,
            authorization,
            req,
            b.key(tenant, target.session_id),
            _echo(opts, target, req),
            ephemeral=not opts.store and target.previous is None and target.conversation is None,
            resp_id=response_id(target.session_id),
        )
        turn = b.turn(authorization, req, run.on_complete, fields={"response_format": "text.format"})
        if not opts.stream:
            return await run.whole(turn)
        try:
            first = await anext(turn)  # an error before the first token still gets its HTTP status
        except BaseException:
            await run.finish()
            raise
        return run.sse(prepend(first, turn))

    async def _target(self, tenant: str, body: dict) -> _Target:
        """The session the response goes to: the one ``previous_response_id`` ends (it must be its
        latest response), the ``conversation`` named (new on first use), or a new one."""
        b = self.backend
        prev, conv = body.get("previous_response_id"), body.get("conversation")
        if prev is not None and conv is not None:
            raise invalid("previous_response_id and conversation cannot both be given", "conversation")
        conv_id = conv.get("id") if isinstance(conv, dict) else conv
        if prev is not None:
            sid = session_of(prev, "previous_response_id")
            s = await b.find(b.key(tenant, sid))
            if s is not None and prev not in s.front.get("responses", {}):
                # a response this replica has not seen: its session went on elsewhere (the store has it)
                s = await b.find_newer(b.key(tenant, sid), s.turn_index + 1)
            if s is None or prev not in s.front.get("responses", {}):
                raise OpenAIError(
                    404,
                    f"No response found with id {prev[:200]!r}",
                    "invalid_request_error",
                    "previous_response_id",
                    "response_not_found",
                )
            if s.front.get("latest_response") != prev:
                raise invalid(
                    "previous_response_id must be the latest response of its conversation (branching "
                    "from an earlier response is not supported)",
                    "previous_response_id",
                )
            return _Target(sid, new=False, previous=prev, conversation=None, expected_turn_index=s.turn_index)
        if conv_id is not None:
            try:
                sid = check_id(conv_id if isinstance(conv_id, str) else "", "conversation")
            except BadSessionId as e:
                raise invalid(str(e), "conversation") from None
            s = await b.find(b.key(tenant, sid))
            return _Target(sid, new=s is None, previous=None, conversation=conv_id)
        return _Target("resp-" + uuid.uuid4().hex, new=True, previous=None, conversation=None)

    # --- GET / DELETE -------------------------------------------------------------------------------
    async def _stored(self, resp_id: str, authorization: str | None):
        b = self.backend
        tenant = b.tenant(authorization)
        key = b.key(tenant, session_of(resp_id))
        s = await b.find(key)
        if s is not None and resp_id not in s.front.get("responses", {}):
            s = await b.find_newer(key, s.turn_index + 1)  # made by another replica after this copy
        record = None if s is None else s.front.get("responses", {}).get(resp_id)
        if record is None:
            raise OpenAIError(
                404,
                f"No response found with id {resp_id[:200]!r}",
                "invalid_request_error",
                "response_id",
                "response_not_found",
            )
        return key, s, record

    async def get(self, resp_id: str, authorization: str | None) -> dict:
        return (await self._stored(resp_id, authorization))[2]

    async def delete(self, resp_id: str, authorization: str | None) -> dict:
        _, s, _ = await self._stored(resp_id, authorization)
        s.front["responses"].pop(resp_id, None)
        if s.front.get("latest_response") == resp_id:
            s.front["latest_response"] = None
        await self.backend.front_changed(s)
        return {"id": resp_id, "object": "response.deleted", "deleted": True}


@dataclass(frozen=True)
class _Options:
    """A create request's own options (not the turn's)."""

    model: str
    stream: bool
    store: bool
    instructions: str | None
    metadata: dict[str, str]
    text: Any
    """``text`` as given (checked to be an object with the turn's fields: its ``format`` is the turn's)."""


@dataclass(frozen=True)
class _Target:
    """The session a response goes to."""

    session_id: str
    new: bool
    """The session does not exist yet (``instructions`` become its system message)."""
    previous: str | None
    """``previous_response_id``, when it was given."""
    conversation: Any
    """``conversation``'s id, when it was given."""
    expected_turn_index: int | None = None


def _options(body: dict, served: str) -> _Options:
    model = rq.check_model(body, served)
    stream, store = body.get("stream", False), body.get("store", True)
    if not isinstance(stream, bool) or not isinstance(store, bool):
        raise invalid("stream and store must be booleans")
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise invalid("instructions must be a string", "instructions")
    metadata = body.get("metadata") or {}
    if (
        not isinstance(metadata, dict)
        or len(metadata) > 16
        or not all(
            isinstance(k, str) and isinstance(v, str) and len(k) <= 64 and len(v) <= 512 for k, v in metadata.items()
        )
    ):
        raise invalid("metadata must map at most 16 short strings to strings", "metadata")
    return _Options(model, stream, store, instructions, metadata, body.get("text") or {})


def _turn_fields(body: dict, opts: _Options) -> TurnRequest:
    """Sampling, tools, tool_choice, ``text.format`` and the ``chainkv`` extension, checked."""
    req = TurnRequest()
    rq.set_sampling(req, body, ("max_output_tokens",))
    rq.set_tools(req, body.get("tools"), nested=False)
    rq.set_tool_choice(req, body.get("tool_choice"), nested=False)
    if not isinstance(opts.text, dict):
        raise invalid("text must be an object", "text")
    rq.set_format(req, opts.text.get("format"), "text.format", nested=False)
    rq.set_extension(req, body)
    return req


def _echo(opts: _Options, target: _Target, req: TurnRequest) -> dict:
    """The request's settings as the response object repeats them."""
    return {
        "model": opts.model,
        "instructions": opts.instructions,
        "metadata": opts.metadata,
        "previous_response_id": target.previous,
        "conversation": {"id": target.session_id} if target.conversation is not None else None,
        "store": opts.store,
        "temperature": req.temperature if req.temperature is not None else 1.0,
        "top_p": req.top_p if req.top_p is not None else 1.0,
        "max_output_tokens": req.max_tokens,
        "tools": [_tool_echo(t) for t in req.tools],
        "tool_choice": _choice_echo(req.tool_choice),
        "text": {"format": opts.text.get("format") or {"type": "text"}},
        "parallel_tool_calls": False,
    }


def _tool_echo(t: Tool) -> dict:
    return {
        "type": "function",
        "name": t.name,
        "description": t.description or None,
        "parameters": json.loads(t.parameters_json) if t.parameters_json else None,
        "strict": False,
    }


def _choice_echo(c: ToolChoice):
    if c.mode == "function":
        return {"type": "function", "name": c.function_name}
    return c.mode or "auto"
