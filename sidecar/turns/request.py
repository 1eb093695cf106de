"""TurnRequest: what a client asks of one turn, typed; the value both fronts build.

gRPC's Turn converts its ``chainkv.v1.TurnRequest`` message (``from_proto``); the HTTP front builds
one from OpenAI JSON (sidecar/http/requests.py). ``TurnRunner.run`` takes it, and
``sidecar.turns.protocol.parse_turn`` checks it against the server's limits, the same way for both. The
fields keep the message's names and meaning; a field the message marks ``optional`` is None when it
is not set.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from sidecar._proto.chainkv.v1 import sidecar_pb2 as pb
from sidecar.turns.validation import request_digest


@dataclass
class ToolCall:
    id: str = ""
    name: str = ""
    arguments_json: str = ""
    """A JSON object."""


@dataclass
class Message:
    role: str
    content: str = ""
    name: str = ""
    tool_call_id: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)


@dataclass
class Tool:
    name: str
    description: str = ""
    parameters_json: str = ""
    """The arguments' JSON Schema (an object); "" for none."""


@dataclass
class ResponseFormat:
    type: str = ""
    json_schema: str = ""
    regex: str = ""
    grammar: str = ""


@dataclass
class ToolChoice:
    mode: str = ""
    function_name: str = ""


@dataclass
class AgentHints:
    priority: int | None = None
    expected_return_s: float | None = None


@dataclass
class SessionControl:
    action: str = ""
    ttl_seconds: float | None = None


@dataclass
class TurnRequest:
    session_id: str = ""
    request_id: str = ""
    messages: list[Message] = field(default_factory=list)
    tools: list[Tool] = field(default_factory=list)
    expected_turn_index: int | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    method: str = ""
    budget: int | None = None
    budget_ratio: float | None = None
    method_args: dict[str, str] = field(default_factory=dict)
    shared_prefix_messages: int | None = None
    public_prefix: bool = False
    response_format: ResponseFormat = field(default_factory=ResponseFormat)
    tool_choice: ToolChoice = field(default_factory=ToolChoice)
    agent_hints: AgentHints | None = None
    session_control: SessionControl | None = None
    digest: str = ""
    """The content's digest (``sidecar.turns.validation.request_digest`` of the gRPC message): a
    request_id reused for other content is refused. "" from a front without request ids."""


def _opt(msg, name: str):
    return getattr(msg, name) if msg.HasField(name) else None


def from_proto(req: pb.TurnRequest) -> TurnRequest:
    """The typed request of a gRPC Turn (its digest included)."""
    return TurnRequest(
        session_id=req.session_id,
        request_id=req.request_id,
        messages=[
            Message(
                role=m.role,
                content=m.content,
                name=m.name,
                tool_call_id=m.tool_call_id,
                tool_calls=[ToolCall(c.id, c.name, c.arguments_json) for c in m.tool_calls],
            )
            for m in req.messages
        ],
        tools=[Tool(t.name, t.description, t.parameters_json) for t in req.tools],
        expected_turn_index=_opt(req, "expected_turn_index"),
        max_tokens=_opt(req, "max_tokens"),
        temperature=_opt(req, "temperature"),
        top_k=_opt(req, "top_k"),
        top_p=_opt(req, "top_p"),
        seed=_opt(req, "seed"),
        stop=list(req.stop),
        ignore_eos=req.ignore_eos,
        presence_penalty=_opt(req, "presence_penalty"),
        frequency_penalty=_opt(req, "frequency_penalty"),
        repetition_penalty=_opt(req, "repetition_penalty"),
        method=req.method,
        budget=_opt(req, "budget"),
        budget_ratio=_opt(req, "budget_ratio"),
        method_args=dict(req.method_args),
        shared_prefix_messages=_opt(req, "shared_prefix_messages"),
        public_prefix=req.public_prefix,
        response_format=ResponseFormat(
            req.response_format.type,
            req.response_format.json_schema,
            req.response_format.regex,
            req.response_format.grammar,
        ),
        tool_choice=ToolChoice(req.tool_choice.mode, req.tool_choice.function_name),
        agent_hints=(
            AgentHints(_opt(req.agent_hints, "priority"), _opt(req.agent_hints, "expected_return_s"))
            if req.HasField("agent_hints")
            else None
        ),
        session_control=(
            SessionControl(req.session_control.action, _opt(req.session_control, "ttl_seconds"))
            if req.HasField("session_control")
            else None
        ),
        digest=request_digest(req),
    )


__all__ = [
    "AgentHints",
    "Message",
    "ResponseFormat",
    "SessionControl",
    "Tool",
    "ToolCall",
    "ToolChoice",
    "TurnRequest",
    "from_proto",
]
