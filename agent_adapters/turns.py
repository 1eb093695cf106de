"""A Turn on the wire, for the clients: the TurnRequest built from a call's arguments, and the streamed
events delivered once across retried attempts of one Turn (``_Resume``).

A stream that broke after some events resumes without repeating them: the retried stream's text
must extend what was delivered (it does for a replay; a re-run that sampled differently raises
``StreamDiverged``).
"""

from __future__ import annotations

import uuid
from typing import Any, Iterable, Sequence

import grpc

from agent_adapters.messages import (
    MessageLike,
    TextDelta,
    ToolCall,
    ToolLike,
    TurnEvent,
    TurnResult,
    as_message,
    as_tool,
)
from agent_adapters.output_format import OUTPUT_FIELDS, response_format_proto, tool_choice_proto
from agent_adapters.retry import StreamDiverged
from sidecar._proto.chainkv.v1 import sidecar_pb2 as pb

SAMPLING_FIELDS = (
    "max_tokens",
    "temperature",
    "top_k",
    "top_p",
    "seed",
    "stop",
    "ignore_eos",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
)
METHOD_FIELDS = ("method", "budget", "budget_ratio", "method_args", "shared_prefix_messages")
HINT_FIELDS = ("priority", "pin_ttl_s", "release", "expected_return_s")
"""Agent hints (engine/chain/hints.py): ``priority`` (an integer in [-100, 100], higher served first),
``pin_ttl_s`` (keep the session on the accelerator this many seconds after the turn, while the
agent's tool runs) or ``release=True`` (the agent is done for now), and ``expected_return_s`` (the
agent expects its next turn this many seconds after this one: a session moved off the accelerator
meanwhile is brought back before then)."""


def build_turn_request(
    session_id: str,
    messages: Iterable[MessageLike],
    *,
    tools: Sequence[ToolLike] = (),
    request_id: str | None = None,
    expected_turn_index: int | None = None,
    **options: Any,
) -> pb.TurnRequest:
    """A TurnRequest; ``options`` are the sampling fields (max_tokens, temperature, top_k, top_p,
    seed, stop, ignore_eos, presence_penalty, frequency_penalty, repetition_penalty) and the session's method fields (method, budget, budget_ratio,
    method_args, shared_prefix_messages), the output fields (response_format, tool_choice: see
    ``agent_adapters.output_format``) and the agent hints (``HINT_FIELDS``). None values are left
    unset (the server's defaults)."""
    known = SAMPLING_FIELDS + METHOD_FIELDS + OUTPUT_FIELDS + HINT_FIELDS
    unknown = set(options) - set(known)
    if unknown:
        raise TypeError(f"unknown Turn option(s) {sorted(unknown)}; known: {known}")
    if options.get("pin_ttl_s") is not None and options.get("release"):
        raise ValueError("a turn cannot both pin its session and release it")
    if options.get("expected_return_s") is not None and options.get("release"):
        raise ValueError("a turn cannot both release its session and expect to return to it")
    req = pb.TurnRequest(
        session_id=session_id,
        request_id=uuid.uuid4().hex if request_id is None else request_id,
        messages=[as_message(m).to_proto() for m in messages],
        tools=[as_tool(t).to_proto() for t in tools],
    )
    if expected_turn_index is not None:
        req.expected_turn_index = expected_turn_index
    for key, value in options.items():
        if value is None:
            continue
        if key == "stop":
            req.stop.extend([value] if isinstance(value, str) else value)
        elif key == "method_args":
            req.method_args.update({k: str(v) for k, v in value.items()})
        elif key == "response_format":
            req.response_format.CopyFrom(response_format_proto(value))
        elif key == "tool_choice":
            req.tool_choice.CopyFrom(tool_choice_proto(value))
        elif key == "priority":
            req.agent_hints.priority = value
        elif key == "expected_return_s":
            req.agent_hints.expected_return_s = value
        elif key == "pin_ttl_s":
            req.session_control.action, req.session_control.ttl_seconds = "pin", value
        elif key == "release":
            if value:
                req.session_control.action = "release"
        else:
            setattr(req, key, value)
    return req


class _Resume:
    """Delivers each event once across retried attempts of one streamed Turn."""

    def __init__(self) -> None:
        self.text, self.tokens, self.calls = "", [], []
        self.attempts = 0

    def new_attempt(self) -> None:
        self.attempts += 1
        self._text, self._tokens, self._calls = "", [], 0

    def feed(self, event: pb.TurnEvent) -> list[TurnEvent]:
        kind = event.WhichOneof("event")
        if kind == "delta":
            self._text += event.delta.text
            self._tokens += event.delta.token_ids
            text = self._extend("text", self._text)
            tokens = self._extend("tokens", self._tokens)
            return [TextDelta(text, tuple(tokens))] if text or tokens else []
        if kind == "tool_call":
            call = ToolCall.from_proto(event.tool_call)
            k, self._calls = self._calls, self._calls + 1
            if k < len(self.calls):
                if (self.calls[k].name, self.calls[k].arguments) != (call.name, call.arguments):
                    raise StreamDiverged(
                        grpc.StatusCode.DATA_LOSS, "the retried turn made a different tool call", self.attempts
                    )
                return []
            self.calls.append(call)
            return [call]
        result = TurnResult.from_proto(event.completion, self.attempts)
        self._extend("text", result.text)
        return [result]

    def _extend(self, what: str, attempt_value):
        """The part of this attempt's cumulative ``what`` not delivered yet (checking they agree)."""
        delivered = self.text if what == "text" else self.tokens
        n = len(delivered)
        if len(attempt_value) <= n:
            ok, new = delivered[: len(attempt_value)] == attempt_value, attempt_value[:0]
        else:
            ok, new = attempt_value[:n] == delivered, attempt_value[n:]
        if not ok:
            raise StreamDiverged(
                grpc.StatusCode.DATA_LOSS,
                "the retried turn re-ran and its reply differs from the part already delivered",
                self.attempts,
            )
        if len(new):
            if what == "text":
                self.text = attempt_value
            else:
                self.tokens = list(attempt_value)
        return new
