"""The typed TurnRequest both fronts build: gRPC's message converts field for field, and the checks
(``parse_turn``) are the same whichever front built it."""

from __future__ import annotations

import pytest

from sidecar._proto.chainkv.v1 import sidecar_pb2 as pb
from sidecar.turns.protocol import InvalidRequest, Limits, parse_turn
from sidecar.turns.request import (
    AgentHints,
    Message,
    ResponseFormat,
    SessionControl,
    Tool,
    ToolCall,
    ToolChoice,
    TurnRequest,
    from_proto,
)
from sidecar.turns.validation import request_digest


def _full_proto() -> pb.TurnRequest:
    return pb.TurnRequest(
        session_id="s",
        request_id="r1",
        messages=[
            pb.Message(role="user", content="hi", name="n"),
            pb.Message(role="assistant", tool_calls=[pb.ToolCall(id="call_0_0", name="f", arguments_json='{"a": 1}')]),
            pb.Message(role="tool", content="out", tool_call_id="call_0_0"),
        ],
        tools=[pb.Tool(name="f", description="d", parameters_json='{"type": "object"}')],
        expected_turn_index=3,
        max_tokens=7,
        temperature=0.5,
        top_k=4,
        top_p=0.9,
        seed=-1,
        stop=["x", "y"],
        ignore_eos=True,
        presence_penalty=0.25,
        frequency_penalty=-0.5,
        repetition_penalty=1.5,
        method="snapkv",
        budget=64,
        budget_ratio=0.5,
        method_args={"k": "v"},
        shared_prefix_messages=1,
        public_prefix=True,
        response_format=pb.ResponseFormat(type="regex", regex="a+"),
        tool_choice=pb.ToolChoice(mode="function", function_name="f"),
        agent_hints=pb.AgentHints(priority=3, expected_return_s=4.5),
        session_control=pb.SessionControl(action="pin", ttl_seconds=30),
    )


def test_from_proto_keeps_every_field():
    req = _full_proto()
    assert from_proto(req) == TurnRequest(
        session_id="s",
        request_id="r1",
        messages=[
            Message("user", "hi", name="n"),
            Message("assistant", tool_calls=[ToolCall("call_0_0", "f", '{"a": 1}')]),
            Message("tool", "out", tool_call_id="call_0_0"),
        ],
        tools=[Tool("f", "d", '{"type": "object"}')],
        expected_turn_index=3,
        max_tokens=7,
        temperature=0.5,
        top_k=4,
        top_p=0.9,
        seed=-1,
        stop=["x", "y"],
        ignore_eos=True,
        presence_penalty=0.25,
        frequency_penalty=-0.5,
        repetition_penalty=1.5,
        method="snapkv",
        budget=64,
        budget_ratio=0.5,
        method_args={"k": "v"},
        shared_prefix_messages=1,
        public_prefix=True,
        response_format=ResponseFormat(type="regex", regex="a+"),
        tool_choice=ToolChoice("function", "f"),
        agent_hints=AgentHints(3, 4.5),
        session_control=SessionControl("pin", 30.0),
        digest=request_digest(req),
    )


def test_an_unset_optional_field_is_none_and_a_zero_is_kept():
    unset = from_proto(pb.TurnRequest(session_id="s", messages=[pb.Message(role="user", content="hi")]))
    assert unset.expected_turn_index is None and unset.max_tokens is None and unset.temperature is None
    assert unset.agent_hints is None and unset.session_control is None and unset.budget is None
    zero = from_proto(pb.TurnRequest(session_id="s", expected_turn_index=0, temperature=0.0, top_k=0))
    assert (zero.expected_turn_index, zero.temperature, zero.top_k) == (0, 0.0, 0)
    hints = from_proto(pb.TurnRequest(agent_hints=pb.AgentHints(), session_control=pb.SessionControl(action="release")))
    assert hints.agent_hints == AgentHints(None, None) and hints.session_control == SessionControl("release", None)


def test_parse_turn_reads_the_typed_request_the_same_from_either_front():
    req = _full_proto()
    req.ClearField("response_format")
    req.ClearField("tool_choice")
    req.ClearField("method")
    req.ClearField("budget")
    req.ClearField("budget_ratio")
    req.method_args.clear()
    grpc_args = parse_turn(from_proto(req), Limits())
    http = TurnRequest(
        session_id="s",
        request_id="r1",
        messages=[Message("user", "hi", name="n")],
        tools=[Tool("f", "d", '{"type": "object"}')],
        expected_turn_index=3,
        max_tokens=7,
        temperature=0.5,
        top_k=4,
        top_p=0.9,
        seed=-1,
        stop=["x", "y"],
        ignore_eos=True,
        presence_penalty=0.25,
        frequency_penalty=-0.5,
        repetition_penalty=1.5,
        shared_prefix_messages=1,
        public_prefix=True,
        agent_hints=AgentHints(3, 4.5),
        session_control=SessionControl("pin", 30.0),
    )
    http_args = parse_turn(http, Limits())
    assert http_args.params == grpc_args.params and http_args.hints == grpc_args.hints
    assert grpc_args.hints.expected_return_s == 4.5 and grpc_args.hints.priority == 3
    assert http_args.expected_turn_index == 3 and http_args.shared_prefix_messages == 1 and http_args.public_prefix
    assert [t.name for t in http_args.tools] == ["f"] and http_args.messages[0]["content"] == "hi"


@pytest.mark.parametrize(
    "where",
    ["content", "name", "stop", "tool", "method_arg", "schema"],
)
def test_a_lone_surrogate_anywhere_is_an_invalid_request(where):
    bad = "a\udc80"
    req = TurnRequest(session_id="s", messages=[Message("user", "hi")])
    if where == "content":
        req.messages[0].content = bad
    elif where == "name":
        req.messages[0].name = bad
    elif where == "stop":
        req.stop = [bad]
    elif where == "tool":
        req.tools = [Tool("f", bad)]
    elif where == "method_arg":
        req.method, req.method_args = "snapkv", {"k": bad}
    else:
        req.response_format = ResponseFormat(type="json_schema", json_schema=bad)
    with pytest.raises(InvalidRequest, match="lone surrogate"):
        parse_turn(req, Limits(max_turn_bytes=10**6))


def test_the_session_id_is_checked_for_either_front():
    for sid in ("", "..", "a/b", "a\x00", "x" * 129):
        with pytest.raises(InvalidRequest):
            parse_turn(TurnRequest(session_id=sid, messages=[Message("user", "hi")]), Limits())
