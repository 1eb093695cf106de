"""Turn requests -> engine arguments, engine state -> gRPC messages: request validation and reply building.

Everything a client can get wrong in a turn (a ``sidecar.turns.request.TurnRequest``, from either
front) is checked here, before the engine sees it, and raised as ``InvalidRequest``
(INVALID_ARGUMENT). Engine state (``SessionInfo`` from the engine client, and
store records) becomes ``chainkv.v1.Session`` messages here too.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from engine.api import (
    InvalidHint,
    MethodError,
    MethodSpec,
    PruneRecord,
    SamplingError,
    SamplingParams,
    SessionHints,
    SessionInfo,
    build_params,
    get_method_class,
)
from sidecar._proto.chainkv.v1 import sidecar_pb2 as pb
from sidecar.session_ids import BadSessionId, check_id
from sidecar.sessions.record import Session
from sidecar.settings import setting
from sidecar.turns.chat import ROLES, ChatError, ToolSpec, tool_from_json
from sidecar.turns.limits import TurnTooLarge
from sidecar.turns.request import Message, TurnRequest
from sidecar.turns.structured import OutputSpec, OutputSpecError
from sidecar.turns.validation import JsonTooDeep, check_turn_bytes, loads_bounded

TIERS = {
    "new": pb.TIER_NEW,
    "gpu": pb.TIER_GPU,
    "host": pb.TIER_HOST,
    "store": pb.TIER_STORE,
    "recompute": pb.TIER_RECOMPUTE,
}
STATES = {
    "active": pb.SESSION_STATE_ACTIVE,
    "idle": pb.SESSION_STATE_IDLE,
    "host": pb.SESSION_STATE_HOST,
    "history": pb.SESSION_STATE_HISTORY,
}
STATE_TIERS = {"idle": "gpu", "host": "host", "history": "recompute"}
FINISH = {"stop": pb.FINISH_REASON_STOP, "length": pb.FINISH_REASON_LENGTH}


class InvalidRequest(ValueError):
    """A request that is malformed as given (INVALID_ARGUMENT)."""


@dataclass
class Limits:
    """What one request may hold (server settings: ``--max-messages``, ..., sidecar/grpc/options.py)."""

    max_messages: int = setting(256, "most messages in one Turn (more: INVALID_ARGUMENT)")
    max_tools: int = setting(128, "most tools in one Turn (more: INVALID_ARGUMENT)")
    max_stop: int = setting(16, "most stop strings in one Turn (more: INVALID_ARGUMENT)")
    max_turn_bytes: int | None = setting(
        None,
        "most UTF-8 bytes of a turn's messages and tools, refused before tokenizing (unset: "
        "BYTES_PER_TOKEN, sidecar/turns/validation.py, bytes per token of the model's context)",
        metavar="BYTES",
    )
    default_max_tokens: int = setting(256, "max_tokens of a Turn that does not set it")


@dataclass
class TurnArgs:
    session_id: str
    request_id: str
    messages: list[dict[str, Any]]
    tools: list[ToolSpec]
    expected_turn_index: int | None
    params: SamplingParams
    method: MethodSpec | None
    shared_prefix_messages: int | None = None
    public_prefix: bool = False
    """The shared prefix may be shared with other tenants' sessions (default: this tenant's only)."""
    output: OutputSpec = field(default_factory=OutputSpec)
    """response_format and tool_choice (sidecar/turns/structured.py)."""
    hints: SessionHints | None = None
    """agent_hints and session_control (engine/chain/hints.py); None: none given."""
    extra: dict[str, Any] = field(default_factory=dict)


def parse_turn(req: TurnRequest, limits: Limits) -> TurnArgs:
    try:
        check_id(req.session_id)
        if req.request_id:
            check_id(req.request_id, "request_id")
    except BadSessionId as e:
        raise InvalidRequest(str(e)) from None
    if not req.messages:
        raise InvalidRequest("a turn needs at least one message")
    if len(req.messages) > limits.max_messages:
        raise InvalidRequest(f"{len(req.messages)} messages in one turn; at most {limits.max_messages}")
    if len(req.tools) > limits.max_tools or len(req.stop) > limits.max_stop:
        raise InvalidRequest(f"at most {limits.max_tools} tools and {limits.max_stop} stop strings")
    check_unicode(req)
    if limits.max_turn_bytes is not None:
        try:
            check_turn_bytes(req, limits.max_turn_bytes)
        except TurnTooLarge as e:
            raise InvalidRequest(str(e)) from None
    messages = [message_dict(m) for m in req.messages]
    try:
        tools = [tool_from_json(t.name, t.description, t.parameters_json) for t in req.tools]
    except ChatError as e:
        raise InvalidRequest(str(e)) from None
    if len({t.name for t in tools}) != len(tools):
        raise InvalidRequest("tool names must be unique")
    try:
        params = SamplingParams(
            max_tokens=_or(req.max_tokens, limits.default_max_tokens),
            temperature=_or(req.temperature, 0.0),
            top_k=_or(req.top_k, 0),
            top_p=_or(req.top_p, 1.0),
            seed=req.seed,
            stop=list(req.stop),
            ignore_eos=req.ignore_eos,
            presence_penalty=_or(req.presence_penalty, 0.0),
            frequency_penalty=_or(req.frequency_penalty, 0.0),
            repetition_penalty=_or(req.repetition_penalty, 1.0),
        )
    except SamplingError as e:
        raise InvalidRequest(str(e)) from None
    expected = req.expected_turn_index
    if expected is not None and expected < 0:
        raise InvalidRequest("expected_turn_index must be >= 0")
    return TurnArgs(
        session_id=req.session_id,
        request_id=req.request_id,
        messages=messages,
        tools=tools,
        expected_turn_index=expected,
        params=params,
        method=method_spec(req),
        shared_prefix_messages=req.shared_prefix_messages,
        public_prefix=req.public_prefix,
        output=output_spec(req),
        hints=session_hints(req),
    )


def check_unicode(req: TurnRequest) -> None:
    """Every string of the turn is text UTF-8 can carry: a JSON body (the HTTP front) can hold a lone
    surrogate, which a gRPC message cannot. InvalidRequest otherwise."""
    rf, tc, control = req.response_format, req.tool_choice, req.session_control
    strings = [req.method, *req.method_args, *req.method_args.values(), *req.stop, rf.type, rf.json_schema, rf.regex]
    strings += [rf.grammar, tc.mode, tc.function_name, control.action if control is not None else ""]
    for m in req.messages:
        strings += [m.role, m.content, m.name, m.tool_call_id]
        strings += [x for c in m.tool_calls for x in (c.id, c.name, c.arguments_json)]
    strings += [x for t in req.tools for x in (t.name, t.description, t.parameters_json)]
    for text in strings:
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            raise InvalidRequest(
                "the turn's text holds a lone surrogate (U+D800-U+DFFF), which is not Unicode text"
            ) from None


def _or(value, default):
    """An optional field's value, or its default when it is not set."""
    return default if value is None else value


PIN_ACTIONS = ("", "pin", "release")


def session_hints(req: TurnRequest) -> SessionHints | None:
    """The request's agent hints, checked as far as the request alone allows (the engine checks the
    TTL against its ``max_pin_ttl_s`` and the pool's pin share)."""
    if req.agent_hints is None and req.session_control is None:
        return None
    action = req.session_control.action if req.session_control is not None else ""
    if action not in PIN_ACTIONS:
        raise InvalidRequest(f"session_control.action must be pin, release or empty, not {action[:64]!r}")
    ttl = req.session_control.ttl_seconds if req.session_control is not None else None
    if (action == "pin") != (ttl is not None):
        raise InvalidRequest('session_control.ttl_seconds goes with action "pin", and "pin" needs it')
    agent = req.agent_hints
    hints = SessionHints(
        priority=agent.priority if agent is not None else None,
        pin_ttl_s=ttl,
        release=action == "release",
        expected_return_s=agent.expected_return_s if agent is not None else None,
    )
    try:
        hints.check(math.inf)
    except InvalidHint as e:
        raise InvalidRequest(str(e)) from None
    return hints


def output_spec(req: TurnRequest) -> OutputSpec:
    rf, tc = req.response_format, req.tool_choice
    try:
        return OutputSpec(
            format=rf.type,
            json_schema=rf.json_schema,
            regex=rf.regex,
            grammar=rf.grammar,
            tool_choice=tc.mode,
            function_name=tc.function_name,
        )
    except OutputSpecError as e:
        raise InvalidRequest(str(e)) from None


def message_dict(m: Message) -> dict[str, Any]:
    if m.role not in ROLES:
        raise InvalidRequest(f"unknown message role {m.role!r}; use one of {', '.join(ROLES)}")
    out: dict[str, Any] = {"role": m.role, "content": m.content}
    if m.name:
        out["name"] = m.name
    if m.tool_call_id:
        out["tool_call_id"] = m.tool_call_id
    if m.tool_calls:
        calls = []
        for c in m.tool_calls:
            try:
                args = loads_bounded(c.arguments_json) if c.arguments_json else {}
            except json.JSONDecodeError as e:
                raise InvalidRequest(f"tool call {c.name!r}: arguments_json is not JSON ({e.msg})") from None
            except JsonTooDeep as e:
                raise InvalidRequest(f"tool call {c.name!r}: arguments_json: {e}") from None
            if not c.name or not isinstance(args, dict):
                raise InvalidRequest("a tool call needs a name and a JSON object of arguments")
            calls.append({"id": c.id, "name": c.name, "arguments": args})
        out["tool_calls"] = calls
    return out


def method_fields(msg) -> dict[str, Any]:
    """A gRPC message's method settings, by ``MethodSpec``'s field names (the Turn and the Session
    messages spell them alike): a map as a dict, an optional field it does not set as None."""
    fields = msg.DESCRIPTOR.fields_by_name
    out: dict[str, Any] = {}
    for name in MethodSpec.field_names():
        f = fields[name]
        if f.message_type is not None and f.message_type.GetOptions().map_entry:
            out[name] = dict(getattr(msg, name))
        else:
            out[name] = getattr(msg, name) if not f.has_presence or msg.HasField(name) else None
    return out


def set_method_fields(msg, spec: MethodSpec) -> None:
    """Write ``spec`` into a gRPC message's method fields (a map's values as strings)."""
    fields = msg.DESCRIPTOR.fields_by_name
    for name, value in spec.to_record().items():
        f = fields[name]
        if f.message_type is not None and f.message_type.GetOptions().map_entry:
            for k, v in value.items():
                getattr(msg, name)[str(k)] = str(v)
        elif value is not None:
            setattr(msg, name, value)


def request_method_fields(req: TurnRequest) -> dict[str, Any]:
    """A typed request's method settings, by ``MethodSpec``'s field names (the request keeps the
    message's names: a field it does not set is None, the map a dict)."""
    values = {name: getattr(req, name) for name in MethodSpec.field_names()}
    return {name: dict(v) if isinstance(v, dict) else v for name, v in values.items()}


def method_spec(req: TurnRequest) -> MethodSpec | None:
    """The request's MethodSpec, or None when it names no method settings."""
    values = request_method_fields(req)
    if not any(v is not None and v != "" and v != {} for v in values.values()):
        return None
    if not values["method"]:
        *settings, last = [n for n in values if n != "method"]
        raise InvalidRequest(f"{', '.join(settings)} and {last} need a method")
    try:
        build_params(get_method_class(values["method"]), values["method_args"])
        return MethodSpec.from_record(values)
    except MethodError as e:
        raise InvalidRequest(str(e)) from None


def tool_call_proto(turn_index: int, k: int, name: str, arguments_json: str) -> pb.ToolCall:
    return pb.ToolCall(id=f"call_{turn_index}_{k}", name=name, arguments_json=arguments_json)


def session_proto(
    session_id: str, info: SessionInfo, s: Session | None, tier: str | None = None, has_store: bool = True
) -> pb.Session:
    out = pb.Session(
        session_id=session_id,
        state=STATES.get(info.state, pb.SESSION_STATE_UNSPECIFIED),
        turn_index=info.turn_index,
        generation=info.generation,
        history_tokens=info.num_tokens,
        digest=info.digest,
        method=info.method,
        kv_tokens=info.kv_tokens,
        kv_pages=info.kv_pages,
        pruned_kv_tokens=info.pruned_tokens,
        shared_prefix_tokens=info.shared_prefix_tokens,
        prune_log=[prune_record_proto(e) for e in info.prune_log],
    )
    set_method_fields(out, info.spec)
    tier = tier or STATE_TIERS.get(info.state)
    if tier:
        out.source_tier = TIERS[tier]
    if s is not None and has_store:
        out.committed_generation = -1 if s.committed_generation is None else s.committed_generation
        if s.stale:
            out.snapshot_state = pb.SNAPSHOT_STATE_CONFLICT
        elif s.snapshot_pending:
            out.snapshot_state = pb.SNAPSHOT_STATE_PENDING
        elif s.committed_generation is not None:
            out.snapshot_state = pb.SNAPSHOT_STATE_COMMITTED
        out.snapshot_error = s.snapshot_error or ""
    return out


def stored_session_proto(session_id: str, record: dict[str, Any]) -> pb.Session:
    """A session known only from its committed store record."""
    tokens = np.frombuffer(record["tokens"], dtype="<u4")
    out = pb.Session(
        session_id=session_id,
        state=pb.SESSION_STATE_STORED,
        turn_index=record["turn_index"],
        generation=record["generation"],
        history_tokens=len(tokens),
        digest=record.get("digest", ""),
        pruned_kv_tokens=record.get("pruned_tokens", 0),
        shared_prefix_tokens=record.get("protected_len", 0),
        prune_log=[prune_record_proto(PruneRecord.from_record(e)) for e in record.get("prune_log", [])],
        source_tier=pb.TIER_STORE,
        snapshot_state=pb.SNAPSHOT_STATE_COMMITTED,
        committed_generation=record["generation"],
    )
    if isinstance(record.get("method"), dict):
        set_method_fields(out, MethodSpec.from_record(record["method"]))
    return out


def prune_record_proto(e: PruneRecord) -> pb.PruneRecord:
    return pb.PruneRecord(
        turn=e.turn,
        start=e.start,
        end=e.end,
        prune_policy=e.policy,
        prune_keep_ratio=e.keep_ratio,
        prune_scope=e.scope,
        reason=e.reason,
        removed=e.removed,
    )
