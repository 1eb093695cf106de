"""``POST /v1/chat/completions`` on chain sessions.

The request's messages are split into the transcript of an existing session (sidecar.http.
conversations) and the new messages after it; only those run as the session's next turn, and
``usage.prompt_tokens_details.cached_tokens`` reports the history whose KV was reused. Replies are
built with the ``openai`` package's own types (``ChatCompletion``, ``ChatCompletionChunk``), so
their shape is the SDK's. Streaming is server-sent events: a role chunk, content chunks, one chunk
per tool call, the finish chunk, then (``stream_options.include_usage``) a usage chunk, then
``[DONE]``. A client that disconnects mid-stream stops the turn, which is rolled back. A request
with ``chain_id`` speaks SparseEngine's chain protocol instead of naming or matching a session
(sidecar/http/chain_protocol.py).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import time
import uuid
from typing import Any, AsyncIterator

from openai.types.chat import ChatCompletion, ChatCompletionChunk

from engine.api import SessionBusy, SessionNotFound, TurnIndexMismatch
from sidecar._proto.chainkv.v1 import sidecar_pb2 as pb
from sidecar.http import chain_protocol
from sidecar.http import requests as rq
from sidecar.http.backend import SessionBackend, prepend
from sidecar.http.conversations import (
    FRONT_KEY,
    FRONT_TURN_KEY,
    TranscriptIndex,
    chain,
    prefix_digests,
    seed_digest,
    session_id_for_key,
    transcript_digest,
)
from sidecar.http.errors import from_exception, invalid
from sidecar.session_ids import SessionKey
from sidecar.turns.chat import tool_from_json, tools_digest
from sidecar.turns.protocol import InvalidRequest, message_dict, request_method_fields
from sidecar.turns.request import Message, ToolCall, TurnRequest

FINISH = {pb.FINISH_REASON_STOP: "stop", pb.FINISH_REASON_LENGTH: "length", pb.FINISH_REASON_TOOL_CALLS: "tool_calls"}
MAX_MESSAGES = 4096
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}


def parse_messages(raw: Any) -> list[Message]:
    if not isinstance(raw, list) or not raw:
        raise invalid("messages must be a non-empty list", "messages")
    if len(raw) > MAX_MESSAGES:
        raise invalid(f"at most {MAX_MESSAGES} messages", "messages")
    out = []
    for i, m in enumerate(raw):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise invalid(f"{where}.role must be one of {', '.join(ROLES)}", "messages")
        role = ROLES[m["role"]]
        msg = Message(role=role, content=rq.text_content(m.get("content"), where, ("text", "refusal")))
        if isinstance(m.get("name"), str):
            msg.name = m["name"][:256]
        if role == "tool":
            if not isinstance(m.get("tool_call_id", ""), str):
                raise invalid(f"{where}.tool_call_id must be a string", "messages")
            msg.tool_call_id = m.get("tool_call_id", "")[:256]
        calls = m.get("tool_calls") if role == "assistant" else None
        if calls:
            if not isinstance(calls, list) or len(calls) > 64:
                raise invalid(f"{where}.tool_calls must be a list", "messages")
            for j, c in enumerate(calls):
                fn = c.get("function") if isinstance(c, dict) else None
                if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
                    raise invalid(f"{where}.tool_calls[{j}] needs a function with a name", "messages")
                call_id = c.get("id") if isinstance(c.get("id"), str) else ""
                msg.tool_calls.append(
                    ToolCall(
                        id=call_id[:256],
                        name=fn["name"][:128],
                        arguments_json=rq.arguments_object(fn.get("arguments", "{}"), f"{where}.tool_calls[{j}]"),
                    )
                )
        out.append(msg)
    return out


def transcript_digests(tenant: str, messages: list[Message], base: TurnRequest) -> tuple[list[dict], list[bytes]]:
    """The messages as dicts, and the digest of each prefix of them (``out[k]``: ``messages[:k]``)
    for ``tenant`` with ``base``'s tools and method (sidecar/http/conversations.py)."""
    try:
        dicts = [message_dict(m) for m in messages]
        tdigest = tools_digest([tool_from_json(t.name, t.description, t.parameters_json) for t in base.tools])
    except (InvalidRequest, ValueError) as e:
        raise invalid(str(e)) from None
    method = json.dumps([sorted(v.items()) if isinstance(v, dict) else v for v in request_method_fields(base).values()])
    return dicts, prefix_digests(seed_digest(tenant, tdigest, method), dicts)


class ChatCompletions:
    def __init__(self, backend: SessionBackend, index: TranscriptIndex | None = None):
        self.backend = backend
        self.index = index or TranscriptIndex()
        self.stored = backend.stored_transcripts(FRONT_KEY, FRONT_TURN_KEY)
        """The same index in the store, shared by the replicas on it (None: no store)."""

    async def create(self, body: dict, authorization: str | None, session_header: str | None):
        """The completion (a dict), or an async iterator of SSE lines when ``stream``."""
        tenant = self.backend.tenant(authorization)
        model = rq.check_model(body, self.backend.model_name)
        if body.get("n") not in (None, 1):
            raise invalid("only n=1 is supported", "n")
        if body.get("logprobs") or body.get("top_logprobs"):
            raise invalid("logprobs are not supported", "logprobs")
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise invalid("stream must be a boolean", "stream")
        opts = body.get("stream_options") or {}
        if not isinstance(opts, dict):
            raise invalid("stream_options must be an object", "stream_options")
        messages = parse_messages(body.get("messages"))
        base = TurnRequest()
        rq.set_sampling(base, body, ("max_completion_tokens", "max_tokens"))
        rq.set_tools(base, body.get("tools"), nested=True)
        rq.set_tool_choice(base, body.get("tool_choice"), nested=True)
        rq.set_format(base, body.get("response_format"), "response_format", nested=True)
        rq.set_extension(base, body)
        roles = [m.role for m in messages]
        chain = chain_protocol.chain_request(body, roles)  # before anything looks the session up
        rq.set_agent_hints(base, body)
        key_hint = None if chain is not None else body.get("prompt_cache_key") or session_header
        if key_hint is not None and (not isinstance(key_hint, str) or not key_hint or len(key_hint) > 1024):
            raise invalid("prompt_cache_key must be a non-empty string of at most 1024 characters", "prompt_cache_key")
        dicts, digests = transcript_digests(tenant, messages, base)
        if chain is not None:
            t = await chain_protocol.resolve(self.backend, tenant, chain, digests, roles)
            plan = _Plan(t.session_id, t.key, t.start, t.turn_index, explicit=True, chain=t)
        else:
            plan = await self._plan(tenant, key_hint, digests, messages)
        run = _Run(self, authorization, base, plan, messages, digests, dicts, model, bool(opts.get("include_usage")))
        if stream:
            events = run.events()
            first = await anext(events)  # an error before the first token still gets its HTTP status
            return run.sse(events, first)
        return await run.whole()

    async def _plan(self, tenant: str, key_hint: str | None, digests: list[bytes], messages: list) -> "_Plan":
        """Which session this request continues, and from which message on."""
        b = self.backend
        if key_hint is not None:
            sid = session_id_for_key(key_hint)
            key = b.key(tenant, sid)
            s = await b.find(key)
            k = _continues(s, digests, messages)
            if k is not None:
                later = sum(1 for m in messages[k:] if m.role == "assistant")
                if later:  # the conversation went on elsewhere (another replica): take the store's copy
                    newer = await b.find_newer(key, s.turn_index + later)
                    k2 = _continues(newer, digests, messages)
                    if k2 is not None:
                        s, k = newer, k2
                return _Plan(sid, key, k, s.turn_index, explicit=True)
            if s is not None:
                await b.end(key)  # the client changed the history: begin the session again
            return _Plan(sid, key, 0, None, explicit=True)
        # a transcript ends after a reply: the candidates, longest first
        candidates = [k for k in range(len(messages) - 1, 0, -1) if messages[k - 1].role == "assistant"]
        here = None
        for k in candidates:  # this replica's index
            key = self.index.get(digests[k])
            if key is None:
                continue
            s = b.local(key)
            if (
                s is not None
                and s.in_engine
                and not s.busy
                and transcript_digest(s.front, s.turn_index) == digests[k].hex()
            ):
                here = _Plan(SessionKey.id_of(key), key, k, s.turn_index, explicit=False)
                break
        longer = [k for k in candidates if here is None or k > here.start]
        if longer and self.stored is not None:  # the store's, for a longer prefix (another replica's turns)
            plan = await self._stored_plan(tenant, [(k, digests[k]) for k in longer], digests, messages)
            if plan is not None:
                return plan
        if here is not None:
            return here
        sid = "chat-" + uuid.uuid4().hex
        return _Plan(sid, b.key(tenant, sid), 0, None, explicit=False)

    async def _stored_plan(self, tenant: str, candidates: list[tuple[int, bytes]], digests, messages) -> "_Plan | None":
        """The session the store's index names for the longest of ``candidates`` (k, digest), loaded
        from its snapshot (as a named session is on a miss); None when there is none."""
        found = await self.backend.find_transcript(self.stored, tenant, [d for _, d in candidates])
        if found is None:
            return None
        k = candidates[found.position][0]
        s = await self.backend.find_newer(found.key, found.turn_index)
        if s is None or s.busy or _continues(s, digests, messages) != k:
            return None
        self.index.put(found.key, digests[k])
        return _Plan(SessionKey.id_of(found.key), found.key, k, s.turn_index, explicit=False)


def _continues(s, digests: list[bytes], messages: list) -> int | None:
    """The longest prefix ``messages[:k]`` (k >= 1) whose digest is the session's transcript, or None."""
    if s is None:
        return None
    have = transcript_digest(s.front, s.turn_index)
    if have is None:
        return None
    for k in range(len(messages) - 1, 0, -1):
        if digests[k].hex() == have:
            return k
    return None


class _Plan:
    def __init__(
        self,
        session_id: str,
        key: str,
        start: int,
        turn_index: int | None,
        explicit: bool,
        chain: chain_protocol.ChainTarget | None = None,
    ):
        self.session_id, self.key, self.start, self.turn_index, self.explicit = (
            session_id,
            key,
            start,
            turn_index,
            explicit,
        )
        self.chain = chain
        """Set for a request of the chain protocol."""


class _Run:
    """One request's turn and the reply built from its events."""

    def __init__(self, owner: ChatCompletions, authorization, base, plan, messages, digests, dicts, model, usage_chunk):
        self.owner, self.authorization, self.base, self.plan = owner, authorization, base, plan
        self.messages, self.digests, self.dicts, self.model = messages, digests, dicts, model
        self.usage_chunk = usage_chunk
        self.id = "chatcmpl-" + uuid.uuid4().hex
        self.created = int(time.time())

    def _request(self, plan: _Plan) -> TurnRequest:
        continuation = plan.start > 0  # the tools are the session's
        return dataclasses.replace(
            self.base,
            session_id=plan.session_id,
            messages=self.messages[plan.start :],
            tools=[] if continuation else list(self.base.tools),
            expected_turn_index=plan.turn_index if continuation else None,
        )

    async def events(self) -> AsyncIterator[pb.TurnEvent]:
        plan, first = self.plan, True
        while True:
            try:
                remember = functools.partial(self._remember, plan)
                async for event in self.owner.backend.turn(self.authorization, self._request(plan), remember):
                    first = False
                    yield event
                return
            except (SessionBusy, TurnIndexMismatch, SessionNotFound) as e:
                mapped = chain_protocol.turn_error(e, self.owner.backend, plan.chain) if plan.chain else None
                if mapped is not None and first:
                    raise mapped from None
                if isinstance(e, SessionNotFound) or not first or plan.explicit or plan.start == 0:
                    raise
                # the matched session moved on or is busy: run this conversation as a new session
                sid = "chat-" + uuid.uuid4().hex
                key = SessionKey.of(SessionKey.tenant_of(plan.key), sid)
                plan = _Plan(sid, str(key), 0, None, False)

    def _remember(self, plan: _Plan, s, c: pb.TurnCompletion) -> None:
        """The session's transcript now ends with this reply (called before the turn's snapshot is
        taken, which then carries it)."""
        reply = {
            "role": "assistant",
            "content": c.text,
            "tool_calls": [{"name": t.name, "arguments": json.loads(t.arguments_json or "{}")} for t in c.tool_calls],
        }
        digest = chain(self.digests[len(self.messages)], reply)
        s.front[FRONT_KEY] = digest.hex()
        s.front[FRONT_TURN_KEY] = s.turn_index
        self.owner.index.put(plan.key, digest)

    async def whole(self) -> dict:
        completion = None
        async for event in self.events():
            if event.HasField("completion"):
                completion = event.completion
        c = completion
        message: dict[str, Any] = {"role": "assistant", "content": c.text if (c.text or not c.tool_calls) else None}
        if c.tool_calls:
            message["tool_calls"] = [_tool_call(t) for t in c.tool_calls]
        out = {
            "id": self.id,
            "object": "chat.completion",
            "created": self.created,
            "model": self.model,
            "choices": [
                {"index": 0, "message": message, "finish_reason": FINISH.get(c.finish_reason, "stop"), "logprobs": None}
            ],
            "usage": _usage(c.usage),
            "system_fingerprint": None,
        }
        reply = ChatCompletion.model_validate(out).model_dump(mode="json", exclude_unset=True)
        if self.plan.chain is not None:
            reply.update(chain_protocol.reply_fields(self.plan.chain))
        return reply

    async def sse(self, events: AsyncIterator[pb.TurnEvent], first: pb.TurnEvent) -> AsyncIterator[str]:
        def chunk(choices, usage=None) -> str:
            body = {
                "id": self.id,
                "object": "chat.completion.chunk",
                "created": self.created,
                "model": self.model,
                "choices": choices,
            }
            if usage is not None:
                body["usage"] = usage
            data = ChatCompletionChunk.model_validate(body).model_dump(mode="json", exclude_unset=True)
            if self.plan.chain is not None:
                data.update(chain_protocol.reply_fields(self.plan.chain))
            return f"data: {json.dumps(data)}\n\n"

        try:
            yield chunk([{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}])
            n_calls = 0
            async for event in prepend(first, events):
                if event.HasField("delta") and event.delta.text:
                    yield chunk([{"index": 0, "delta": {"content": event.delta.text}, "finish_reason": None}])
                elif event.HasField("tool_call"):
                    call = dict(_tool_call(event.tool_call), index=n_calls)
                    n_calls += 1
                    yield chunk([{"index": 0, "delta": {"tool_calls": [call]}, "finish_reason": None}])
                elif event.HasField("completion"):
                    c = event.completion
                    yield chunk([{"index": 0, "delta": {}, "finish_reason": FINISH.get(c.finish_reason, "stop")}])
                    if self.usage_chunk:
                        yield chunk([], _usage(c.usage))
        except Exception as e:  # headers are sent: the error is the stream's last event
            yield f"data: {json.dumps(from_exception(e).body())}\n\n"
        finally:
            await events.aclose()
        yield "data: [DONE]\n\n"


def _tool_call(t: pb.ToolCall) -> dict:
    return {"id": t.id, "type": "function", "function": {"name": t.name, "arguments": t.arguments_json or "{}"}}


def _usage(u: pb.Usage) -> dict:
    prompt = max(0, u.history_tokens - u.generated_tokens)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": u.generated_tokens,
        "total_tokens": prompt + u.generated_tokens,
        "prompt_tokens_details": {"cached_tokens": u.reused_tokens},
    }
