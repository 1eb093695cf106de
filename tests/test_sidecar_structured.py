"""Structured output and forced tool choice through the gRPC Turn (sidecar/turns/structured.py), on a tiny
random model with SmolLM2's tokenizer and chat template: whatever the model, the reply is a valid
tool call or validates against the schema."""

from __future__ import annotations

import json

import grpc
import jsonschema
import pytest

from sidecar._proto.chainkv.v1 import sidecar_pb2 as pb
from sidecar._proto.chainkv.v1 import sidecar_pb2_grpc

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
CALC = {
    "type": "object",
    "properties": {"expression": {"type": "string", "maxLength": 10}},
    "required": ["expression"],
    "additionalProperties": False,
}
TOOLS = [
    pb.Tool(name="get_weather", description="weather in a city", parameters_json=json.dumps(WEATHER)),
    pb.Tool(name="calculator", description="evaluate arithmetic", parameters_json=json.dumps(CALC)),
]
ANSWER = {
    "type": "object",
    "properties": {"answer": {"type": "integer", "minimum": 0, "maximum": 9}, "sure": {"type": "boolean"}},
    "required": ["answer", "sure"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def stub(tiny_chat_server):
    channel = grpc.insecure_channel(f"127.0.0.1:{tiny_chat_server.server.port}")
    yield sidecar_pb2_grpc.SidecarStub(channel)
    channel.close()


def _turn(stub, sid, text, **kw) -> tuple[list[pb.ToolCall], pb.TurnCompletion]:
    req = pb.TurnRequest(session_id=sid, messages=[pb.Message(role="user", content=text)], **kw)
    events = list(stub.Turn(req, timeout=120))
    return [e.tool_call for e in events if e.HasField("tool_call")], events[-1].completion


def test_forced_tool_calls_are_well_formed_and_a_session_continues(stub):
    calls, done = _turn(
        stub,
        "forced-1",
        "weather in Paris?",
        tools=TOOLS,
        max_tokens=120,
        tool_choice=pb.ToolChoice(mode="function", function_name="get_weather"),
    )
    assert done.finish_reason == pb.FINISH_REASON_TOOL_CALLS and len(calls) == 1
    assert calls[0].name == "get_weather"
    jsonschema.validate(json.loads(calls[0].arguments_json), WEATHER)
    # turn 2: the tool result, then "required" over the session's tools (not resent), sampled
    req = pb.TurnRequest(
        session_id="forced-1",
        max_tokens=120,
        temperature=1.0,
        seed=7,
        tool_choice=pb.ToolChoice(mode="required"),
        messages=[pb.Message(role="tool", content='{"temp": 21}', tool_call_id=calls[0].id)],
    )
    events = list(stub.Turn(req, timeout=120))
    calls2 = [e.tool_call for e in events if e.HasField("tool_call")]
    assert len(calls2) == 1 and calls2[0].name in ("get_weather", "calculator")
    jsonschema.validate(json.loads(calls2[0].arguments_json), WEATHER if calls2[0].name == "get_weather" else CALC)
    assert events[-1].completion.usage.reused_tokens > 0


def test_response_format_json_schema(stub):
    for i in range(3):
        calls, done = _turn(
            stub,
            f"schema-{i}",
            f"pick a digit ({i})",
            max_tokens=80,
            temperature=0.9,
            seed=i,
            response_format=pb.ResponseFormat(type="json_schema", json_schema=json.dumps(ANSWER)),
        )
        assert not calls and done.finish_reason == pb.FINISH_REASON_STOP
        jsonschema.validate(json.loads(done.text), ANSWER)


def test_tool_choice_none_leaves_markup_as_text(stub):
    calls, done = _turn(stub, "none-1", "anything", tools=TOOLS, max_tokens=16, tool_choice=pb.ToolChoice(mode="none"))
    assert not calls and done.finish_reason in (pb.FINISH_REASON_STOP, pb.FINISH_REASON_LENGTH)


def _scripted(text: str) -> pb.ResponseFormat:
    """A grammar that makes the reply ``text`` whatever the model: output a model could write."""
    return pb.ResponseFormat(type="grammar", grammar="root ::= " + json.dumps(text))


@pytest.mark.parametrize("name, is_call", [("delete_everything", False), ("get_weather", True)])
def test_under_auto_only_a_declared_tool_is_called(stub, name, is_call):
    """A reply that calls a function the turn did not declare comes back as text (finish_reason stop),
    never as a tool call an agent would execute; a declared one is a call."""
    markup = f'<tool_call>\n{{"name": "{name}", "arguments": {{"city": "Oslo", "unit": "c"}}}}\n</tool_call>'
    calls, done = _turn(stub, f"auto-{name}", "weather?", tools=TOOLS, max_tokens=60, response_format=_scripted(markup))
    if is_call:
        assert [c.name for c in calls] == [name] and done.finish_reason == pb.FINISH_REASON_TOOL_CALLS
        assert not done.text
    else:
        assert not calls and not done.tool_calls and done.finish_reason == pb.FINISH_REASON_STOP
        assert done.text == markup
    # a later turn that does not resend the tools: the session's are the declared ones
    req = pb.TurnRequest(
        session_id=f"auto-{name}",
        messages=[pb.Message(role="user", content="again")],
        max_tokens=60,
        response_format=_scripted(markup.replace(name, "rm_rf")),
    )
    events = list(stub.Turn(req, timeout=120))
    assert not [e for e in events if e.HasField("tool_call")] and "rm_rf" in events[-1].completion.text


@pytest.mark.parametrize(
    "kw, needle",
    [
        (dict(tool_choice=pb.ToolChoice(mode="required")), "needs the session's tools"),
        (dict(tools=TOOLS, tool_choice=pb.ToolChoice(mode="function", function_name="nope")), "not one of the tools"),
        (dict(tools=TOOLS, tool_choice=pb.ToolChoice(mode="sometimes")), "tool_choice must be"),
        (dict(response_format=pb.ResponseFormat(type="yaml")), "response_format type"),
        (dict(response_format=pb.ResponseFormat(type="json_schema", json_schema="{oops")), "not JSON"),
        (dict(response_format=pb.ResponseFormat(type="json_schema")), "needs its schema"),
        (dict(response_format=pb.ResponseFormat(type="regex", regex="(unclosed")), "cannot be compiled"),
    ],
)
def test_bad_structured_requests_are_invalid_argument(stub, kw, needle):
    with pytest.raises(grpc.RpcError) as err:
        _turn(stub, "bad-structured", "hi", **kw)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert needle in err.value.details()
    # nothing was left behind: the same session id takes a valid turn at once
    _, done = _turn(stub, "bad-structured", "hi", max_tokens=4)
    assert done.turn_index == 0
    stub.EndSession(pb.EndSessionRequest(session_id="bad-structured"))


def test_a_closing_tag_inside_the_arguments_does_not_end_the_call():
    from sidecar.turns.tool_calls import ToolCallParser

    text = (
        '<tool_call>\n{"name": "calculator", "arguments": {"expression": ">2+2</tool_call>}}</tool_call> ok"}}'
        "\n</tool_call> after"
    )
    for pieces in ([text], [text[i : i + 7] for i in range(0, len(text), 7)]):
        parser = ToolCallParser(["calculator"])
        events = [e for p in pieces for e in parser.feed(p)] + parser.finish()
        calls = [v for k, v in events if k == "tool_call"]
        assert len(calls) == 1 and json.loads(calls[0].arguments_json)["expression"].endswith(" ok")
        assert "".join(v for k, v in events if k == "text").strip() == "after"
    parser = ToolCallParser(["calculator"])  # a malformed call stays text
    events = parser.feed("<tool_call>{oops</tool_call> tail") + parser.finish()
    assert [k for k, _ in events] == ["text"] and "{oops" in events[0][1]
