"""The per-request bounds (sidecar/turns/validation.py): JSON depth measured without recursion, turn text
bounded in bytes, a request_id bound to its request's content."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sidecar._proto.chainkv.v1 import sidecar_pb2 as pb
from sidecar.turns.chat import ChatError, tool_from_json
from sidecar.turns.limits import TurnTooLarge
from sidecar.turns.tool_calls import ToolCallParser
from sidecar.turns.validation import (
    JsonTooDeep,
    check_turn_bytes,
    json_depth,
    loads_bounded,
    request_digest,
    turn_text_bytes,
)

_json = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(), st.text(alphabet='[]{}"\\ab:,', max_size=6)),
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=3), inner, max_size=3)),
    max_leaves=30,
)


def _depth(v) -> int:
    if isinstance(v, list):
        return 1 + max((_depth(x) for x in v), default=0)
    if isinstance(v, dict):
        return 1 + max((_depth(x) for x in v.values()), default=0)
    return 0


@given(_json)
def test_json_depth_matches_the_parsed_nesting(value):
    text = json.dumps(value)
    assert json_depth(text) == _depth(value)
    if _depth(value) <= 64:
        assert loads_bounded(text) == value


@pytest.mark.parametrize("depth", [65, 5000, 200_000])
def test_deep_json_is_refused_everywhere_it_is_read(depth):
    deep = "[" * depth + "]" * depth
    with pytest.raises(JsonTooDeep):
        loads_bounded(deep)
    with pytest.raises(ChatError, match="nested"):
        tool_from_json("f", "", '{"type": "object", "p": ' + deep + "}")
    # the model's own tool call with deep arguments stays text instead of failing the turn
    events = ToolCallParser(["f"]).feed('<tool_call>{"name": "f", "arguments": {"a": ' + deep + "}}</tool_call>")
    assert all(kind == "text" for kind, _ in events)


def test_turn_text_is_bounded_in_bytes_before_tokenizing():
    req = pb.TurnRequest(
        session_id="s",
        messages=[pb.Message(role="user", content="é" * 600)],
        tools=[pb.Tool(name="t", parameters_json="{}")],
    )
    assert turn_text_bytes(req) == 1200 + 1 + 2
    check_turn_bytes(req, 1203)
    with pytest.raises(TurnTooLarge):
        check_turn_bytes(req, 1202)


def test_a_request_digest_ignores_ids_and_precondition_only():
    base = pb.TurnRequest(
        session_id="a",
        request_id="r",
        expected_turn_index=2,
        max_tokens=4,
        messages=[pb.Message(role="user", content="x")],
    )
    same = pb.TurnRequest(session_id="b", request_id="q", max_tokens=4, messages=[pb.Message(role="user", content="x")])
    assert request_digest(base) == request_digest(same)
    for change in (dict(max_tokens=5), dict(temperature=0.5), dict(stop=["z"]), dict(ignore_eos=True)):
        other = pb.TurnRequest(
            session_id="a",
            request_id="r",
            messages=[pb.Message(role="user", content="x")],
            **{"max_tokens": 4, **change},
        )
        assert request_digest(other) != request_digest(base)
