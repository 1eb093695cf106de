"""The Responses API's output of one turn: its output items, SSE events and final response record.

``ResponseRun`` turns a turn's events (text deltas, tool calls, the completion) into the
Responses API's output items (``message``, ``function_call``) and, streaming, its events
(created, in_progress, output_item.added, content_part.added, output_text.delta ...,
function_call_arguments.delta/done, output_item.done, completed or incomplete, or failed), every
one validated against the ``openai`` package's event types; the final response is validated as a
``Response``. The final response is kept with the session (``Session.front``, the last
``MAX_STORED``) by the turn runner's ``on_complete`` hook, so it travels with the turn's snapshot.
``sidecar.http.responses_api`` parses the request and serves ``GET`` / ``DELETE`` from these records.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import AsyncIterator

from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from sidecar._proto.chainkv.v1 import sidecar_pb2 as pb
from sidecar.http.backend import SessionBackend
from sidecar.http.errors import from_exception
from sidecar.turns.request import TurnRequest

MAX_STORED = 32
"""Responses kept per session for GET (the oldest are dropped)."""
_EVENT = TypeAdapter(ResponseStreamEvent)


class ResponseRun:
    """One ``POST /v1/responses``: its output items, its events and its final response record."""

    def __init__(
        self,
        backend: SessionBackend,
        authorization,
        req: TurnRequest,
        key: str,
        echo: dict,
        ephemeral: bool,
        resp_id: str,
    ):
        self.backend, self.authorization, self.req, self.key, self.echo = backend, authorization, req, key, echo
        self.ephemeral = ephemeral
        self.id = resp_id
        """The response's id (``responses_api.response_id``: it names the session)."""
        self.created = time.time()
        self.output: list[dict] = []
        self.seq = 0
        self.final: dict | None = None
        self.message: dict | None = None
        """The output message being streamed (None between items)."""
        self.closing: list[str] = []
        """The events that close the last message, made with the final response."""

    def response(self, status: str, completion: pb.TurnCompletion | None = None) -> dict:
        body = dict(
            self.echo,
            id=self.id,
            object="response",
            created_at=self.created,
            status=status,
            output=self.output,
            error=None,
            incomplete_details=None,
            usage=None,
        )
        if completion is not None:
            u = completion.usage
            prompt = max(0, u.history_tokens - u.generated_tokens)
            body["usage"] = {
                "input_tokens": prompt,
                "input_tokens_details": {"cached_tokens": u.reused_tokens, "cache_write_tokens": 0},
                "output_tokens": u.generated_tokens,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": prompt + u.generated_tokens,
            }
            if completion.finish_reason == pb.FINISH_REASON_LENGTH:
                body["incomplete_details"] = {"reason": "max_output_tokens"}
        # by_alias: the openai types name some fields apart from their JSON key (``text.format``'s
        # ``schema`` is the attribute ``schema_``); the JSON the client reads has the key
        return Response.model_validate(body).model_dump(mode="json", by_alias=True, exclude_none=False)

    def event(self, kind: str, **fields) -> str:
        data = _EVENT.validate_python(dict(fields, type=kind, sequence_number=self.seq))
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps(data.model_dump(mode='json', by_alias=True))}\n\n"

    async def _events(self, turn: AsyncIterator[pb.TurnEvent]) -> AsyncIterator[str]:
        """SSE text of the Responses API's events, while the output items are built."""
        yield self.event("response.created", response=self.response("in_progress"))
        yield self.event("response.in_progress", response=self.response("in_progress"))
        async for ev in turn:
            if ev.HasField("delta") and ev.delta.text:
                if self.message is None:
                    self.message = {
                        "id": "msg_" + uuid.uuid4().hex,
                        "type": "message",
                        "role": "assistant",
                        "status": "in_progress",
                        "content": [],
                    }
                    yield self.event(
                        "response.output_item.added", output_index=len(self.output), item=dict(self.message)
                    )
                    self.output.append(self.message)
                    yield self.event(
                        "response.content_part.added",
                        item_id=self.message["id"],
                        output_index=len(self.output) - 1,
                        content_index=0,
                        part={"type": "output_text", "text": "", "annotations": []},
                    )
                    self.message["content"] = [{"type": "output_text", "text": "", "annotations": [], "logprobs": []}]
                self.message["content"][0]["text"] += ev.delta.text
                yield self.event(
                    "response.output_text.delta",
                    item_id=self.message["id"],
                    output_index=len(self.output) - 1,
                    content_index=0,
                    delta=ev.delta.text,
                    logprobs=[],
                )
            elif ev.HasField("tool_call"):
                for e in self._close(self.message):
                    yield e
                self.message = None
                t = ev.tool_call
                item = {
                    "id": "fc_" + uuid.uuid4().hex,
                    "type": "function_call",
                    "call_id": t.id,
                    "name": t.name,
                    "arguments": "",
                    "status": "in_progress",
                }
                yield self.event("response.output_item.added", output_index=len(self.output), item=dict(item))
                self.output.append(item)
                idx = len(self.output) - 1
                yield self.event(
                    "response.function_call_arguments.delta",
                    item_id=item["id"],
                    output_index=idx,
                    delta=t.arguments_json or "{}",
                )
                item.update(arguments=t.arguments_json or "{}", status="completed")
                yield self.event(
                    "response.function_call_arguments.done",
                    item_id=item["id"],
                    output_index=idx,
                    arguments=item["arguments"],
                    name=t.name,
                )
                yield self.event("response.output_item.done", output_index=idx, item=dict(item))
            elif ev.HasField("completion"):  # on_complete made the final response
                for e in self.closing:
                    yield e
                yield self.event(f"response.{self.final['status']}", response=self.final)

    def on_complete(self, session, completion: pb.TurnCompletion) -> None:
        """The turn runner's hook, called when the turn finished and before its snapshot is taken (every
        output item has been streamed by then): the final response, kept with the session, so it travels
        with the turn's own snapshot (durability sync: committed before the reply is sent, so a
        response the client got resolves on any replica even if this one dies right after)."""
        self.closing = self._close(self.message)
        self.message = None
        status = "incomplete" if completion.finish_reason == pb.FINISH_REASON_LENGTH else "completed"
        self.final = self.response(status, completion)
        self._record(session, self.final)

    def _close(self, message: dict | None):
        if message is None:
            return []
        idx = self.output.index(message)
        part = message["content"][0]
        message["status"] = "completed"
        return [
            self.event(
                "response.output_text.done",
                item_id=message["id"],
                output_index=idx,
                content_index=0,
                text=part["text"],
                logprobs=[],
            ),
            self.event(
                "response.content_part.done",
                item_id=message["id"],
                output_index=idx,
                content_index=0,
                part={"type": "output_text", "text": part["text"], "annotations": []},
            ),
            self.event("response.output_item.done", output_index=idx, item=dict(message)),
        ]

    def _record(self, s, final: dict) -> None:
        """Keep the response with its session (``Session.front``, saved with its snapshots)."""
        stored = s.front.setdefault("responses", {})
        if self.echo["store"]:
            stored[self.id] = final
            while len(stored) > MAX_STORED:
                stored.pop(next(iter(stored)))
            s.front["latest_response"] = self.id
        else:
            s.front["latest_response"] = None

    async def finish(self) -> None:
        if self.ephemeral:
            await self.backend.end(self.key)

    async def whole(self, turn: AsyncIterator[pb.TurnEvent]) -> dict:
        try:
            async for _ in self._events(turn):
                pass
        finally:
            await self.finish()
        return self.final

    async def sse(self, turn: AsyncIterator[pb.TurnEvent]) -> AsyncIterator[str]:
        try:
            async for text in self._events(turn):
                yield text
        except Exception as e:  # headers are sent: a failed event ends the stream
            err = from_exception(e)
            code = "server_error" if err.status >= 500 else "invalid_prompt"
            failed = dict(self.response("in_progress"), status="failed", error={"code": code, "message": err.message})
            yield self.event("response.failed", response=failed)
        finally:
            await turn.aclose()
            await self.finish()


__all__ = ["MAX_STORED", "ResponseRun"]
