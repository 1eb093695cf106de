"""Plain Python values for what a Turn sends and returns, and their conversion to and from the stubs.

The adapters speak these (not protobuf): ``ChatMessage`` and ``ToolSpec`` go in; a stream of
``TextDelta`` and ``ToolCall`` events comes out, then one ``TurnResult`` with its ``Usage``.
Messages and tools may also be given as OpenAI-style dicts (``{"role": ..., "content": ...}``,
``{"type": "function", "function": {"name", "description", "parameters"}}``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Mapping, Union

from sidecar._proto.chainkv.v1 import sidecar_pb2 as pb

FINISH_REASONS = {
    pb.FINISH_REASON_UNSPECIFIED: "unspecified",
    pb.FINISH_REASON_STOP: "stop",
    pb.FINISH_REASON_LENGTH: "length",
    pb.FINISH_REASON_TOOL_CALLS: "tool_calls",
}
TIERS = {
    pb.TIER_UNSPECIFIED: "unspecified",
    pb.TIER_NEW: "new",
    pb.TIER_GPU: "gpu",
    pb.TIER_HOST: "host",
    pb.TIER_STORE: "store",
    pb.TIER_RECOMPUTE: "recompute",
}


@dataclass(frozen=True)
class ToolCall:
    """A call the model made (or one a client supplies in an assistant message)."""

    id: str
    name: str
    arguments: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_proto(cls, c: pb.ToolCall) -> "ToolCall":
        try:
            args = json.loads(c.arguments_json) if c.arguments_json else {}
        except json.JSONDecodeError:
            args = {"_raw": c.arguments_json}
        return cls(c.id, c.name, args if isinstance(args, dict) else {"_raw": args})

    def to_proto(self) -> pb.ToolCall:
        return pb.ToolCall(id=self.id, name=self.name, arguments_json=json.dumps(self.arguments, separators=(",", ":")))


@dataclass(frozen=True)
class ChatMessage:
    role: str
    """``system``, ``user``, ``assistant`` or ``tool``."""
    content: str = ""
    name: str = ""
    """role ``tool``: the tool's name."""
    tool_call_id: str = ""
    """role ``tool``: the ToolCall.id this answers."""
    tool_calls: tuple[ToolCall, ...] = ()
    """role ``assistant``: calls in a reply the client supplies."""

    def to_proto(self) -> pb.Message:
        return pb.Message(
            role=self.role,
            content=self.content,
            name=self.name,
            tool_call_id=self.tool_call_id,
            tool_calls=[c.to_proto() for c in self.tool_calls],
        )


@dataclass(frozen=True)
class ToolSpec:
    name: str
    description: str = ""
    parameters: Mapping[str, Any] = field(default_factory=dict)
    """The arguments' JSON Schema (an object)."""

    def to_proto(self) -> pb.Tool:
        return pb.Tool(
            name=self.name,
            description=self.description,
            parameters_json=json.dumps(dict(self.parameters)) if self.parameters else "",
        )


MessageLike = Union[ChatMessage, Mapping[str, Any]]
ToolLike = Union[ToolSpec, Mapping[str, Any]]


def as_message(m: MessageLike) -> ChatMessage:
    if isinstance(m, ChatMessage):
        return m
    calls = []
    for c in m.get("tool_calls") or ():
        if isinstance(c, ToolCall):
            calls.append(c)
            continue
        fn = c.get("function", c)  # OpenAI nests name/arguments under "function"
        args = fn.get("arguments", fn.get("args", {}))
        if isinstance(args, str):
            args = json.loads(args) if args.strip() else {}
        calls.append(ToolCall(c.get("id", ""), fn["name"], dict(args)))
    return ChatMessage(
        role=m["role"],
        content=m.get("content") or "",
        name=m.get("name") or "",
        tool_call_id=m.get("tool_call_id") or "",
        tool_calls=tuple(calls),
    )


def as_tool(t: ToolLike) -> ToolSpec:
    if isinstance(t, ToolSpec):
        return t
    fn = t.get("function", t) if t.get("type", "function") == "function" else t
    return ToolSpec(fn["name"], fn.get("description") or "", fn.get("parameters") or {})


@dataclass(frozen=True)
class TextDelta:
    """Text sampled since the previous delta (and its token ids)."""

    text: str
    token_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int = 0
    """Tokens this turn appended to the session's history."""
    reused_tokens: int = 0
    """History tokens whose KV was already cached (the chain cache at work)."""
    prefilled_tokens: int = 0
    pruned_tokens: int = 0
    generated_tokens: int = 0
    time_to_first_token_s: float = 0.0
    source_tier: str = "unspecified"
    history_tokens: int = 0
    kv_tokens: int = 0
    timing: dict[str, float] = field(default_factory=dict)
    """Where the turn's time went on the engine (seconds by cause: chainkv.v1.TurnTiming's fields)."""
    recall: dict[str, int] = field(default_factory=dict)
    """What the recall tier copied during the turn (chainkv.v1.RecallTraffic's fields; empty without it)."""

    @classmethod
    def from_proto(cls, u: pb.Usage) -> "Usage":
        timing = {f.name: getattr(u.timing, f.name) for f in u.timing.DESCRIPTOR.fields} if u.HasField("timing") else {}
        recall = {f.name: getattr(u.recall, f.name) for f in u.recall.DESCRIPTOR.fields} if u.HasField("recall") else {}
        return cls(
            u.prompt_tokens,
            u.reused_tokens,
            u.prefilled_tokens,
            u.pruned_tokens,
            u.generated_tokens,
            u.time_to_first_token_s,
            TIERS.get(u.source_tier, "unspecified"),
            u.history_tokens,
            u.kv_tokens,
            timing,
            recall,
        )

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass(frozen=True)
class TurnResult:
    session_id: str
    request_id: str
    turn_index: int
    generation: int
    finish_reason: str
    """``stop``, ``length`` or ``tool_calls``."""
    text: str
    tool_calls: tuple[ToolCall, ...]
    token_ids: tuple[int, ...]
    usage: Usage
    replayed: bool
    """The server answered a retried request_id from its record instead of running the turn again."""
    attempts: int = 1
    """How many times the client sent the request (retries reuse the request_id)."""

    @classmethod
    def from_proto(cls, c: pb.TurnCompletion, attempts: int = 1) -> "TurnResult":
        return cls(
            c.session_id,
            c.request_id,
            c.turn_index,
            c.generation,
            FINISH_REASONS.get(c.finish_reason, "unspecified"),
            c.text,
            tuple(ToolCall.from_proto(t) for t in c.tool_calls),
            tuple(c.token_ids),
            Usage.from_proto(c.usage),
            c.replayed,
            attempts,
        )


TurnEvent = Union[TextDelta, ToolCall, TurnResult]

__all__ = [
    "ChatMessage",
    "MessageLike",
    "TextDelta",
    "ToolCall",
    "ToolLike",
    "ToolSpec",
    "TurnEvent",
    "TurnResult",
    "Usage",
    "as_message",
    "as_tool",
]
