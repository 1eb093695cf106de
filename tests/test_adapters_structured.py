"""Forced tool choice and structured output through the framework adapters, against a real sidecar
over gRPC on a tiny random model with SmolLM2's tokenizer and chat template: whatever the model
samples, the grammar makes the call well formed and the output parse, so these tests show the
adapters' plumbing (LangChain ``bind_tools(tool_choice=...)`` and ``with_structured_output``,
LlamaIndex ``structured_predict``), not the model's judgement."""

from __future__ import annotations

import asyncio
import json
from typing import Literal

import jsonschema
import pytest

pytest.importorskip("langchain_core")
pytest.importorskip("llama_index.core")

from pydantic import BaseModel, Field  # noqa: E402

from agent_adapters.client import build_turn_request  # noqa: E402

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["c", "f"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
CALC = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate arithmetic.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string", "maxLength": 10}},
            "required": ["expression"],
            "additionalProperties": False,
        },
    },
}
SCHEMAS = {"get_weather": WEATHER["function"]["parameters"], "calculator": CALC["function"]["parameters"]}


class Answer(BaseModel):
    """A digit and whether the model is sure of it."""

    answer: int = Field(ge=0, le=9)
    sure: bool


@pytest.fixture(scope="module")
def target(tiny_chat_server):
    return f"127.0.0.1:{tiny_chat_server.server.port}"


def _chat(target, **kw):
    from agent_adapters.langchain import ChatChainKV

    return ChatChainKV(target=target, **{"max_tokens": 120, "temperature": 1.0, "seed": 3, **kw})


# --- the Turn fields ------------------------------------------------------------------------------


def test_openai_shaped_options_become_the_turn_fields():
    req = build_turn_request(
        "s",
        [{"role": "user", "content": "hi"}],
        tool_choice="any",
        response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "object"}}},
    )
    assert req.tool_choice.mode == "required" and req.response_format.type == "json_schema"
    assert json.loads(req.response_format.json_schema) == {"type": "object"}
    req = build_turn_request(
        "s", [], tool_choice={"type": "function", "function": {"name": "calculator"}}, response_format="json_object"
    )
    assert (req.tool_choice.mode, req.tool_choice.function_name) == ("function", "calculator")
    assert req.response_format.type == "json_object"
    for bad in ("sometimes", {"type": "function"}, 3):
        with pytest.raises(ValueError):
            build_turn_request("s", [], tool_choice=bad)
    with pytest.raises(ValueError, match="needs its schema"):
        build_turn_request("s", [], response_format={"type": "json_schema"})


# --- LangChain --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "choice",
    ["get_weather", "calculator", "required", "any", True, {"type": "function", "function": {"name": "calculator"}}],
)
def test_langchain_bind_tools_forces_a_well_formed_call(target, choice):
    msg = _chat(target).bind_tools([WEATHER, CALC], tool_choice=choice).invoke("What is the weather in Paris?")
    assert len(msg.tool_calls) == 1 and msg.response_metadata["finish_reason"] == "tool_calls"
    call = msg.tool_calls[0]
    if isinstance(choice, str) and choice in SCHEMAS:
        assert call["name"] == choice
    elif isinstance(choice, dict):
        assert call["name"] == "calculator"
    jsonschema.validate(call["args"], SCHEMAS[call["name"]])


def test_langchain_tool_choice_none_and_auto_and_bad_names(target):
    llm = _chat(target, max_tokens=12)
    msg = llm.bind_tools([WEATHER], tool_choice="none").invoke("hi")
    assert msg.tool_calls == [] and msg.response_metadata["finish_reason"] in ("stop", "length")
    assert llm.bind_tools([WEATHER], tool_choice="auto").invoke("hi").response_metadata["chainkv_usage"]
    with pytest.raises(ValueError, match="neither a mode"):
        llm.bind_tools([WEATHER], tool_choice="get_time")


def test_langchain_streams_a_forced_call(target):
    chunks = list(_chat(target).bind_tools([WEATHER], tool_choice="get_weather").stream("Weather in Oslo?"))
    msg = chunks[0]
    for c in chunks[1:]:
        msg = msg + c
    assert [c["name"] for c in msg.tool_calls] == ["get_weather"]
    jsonschema.validate(msg.tool_calls[0]["args"], SCHEMAS["get_weather"])


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_langchain_with_structured_output_pydantic(target, method):
    out = _chat(target).with_structured_output(Answer, method=method).invoke("Pick a digit.")
    assert isinstance(out, Answer) and 0 <= out.answer <= 9


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_langchain_with_structured_output_dict_schema_and_raw(target, method):
    schema = {
        "title": "pick",
        "description": "a digit",
        "type": "object",
        "properties": {"answer": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["answer"],
        "additionalProperties": False,
    }
    out = _chat(target).with_structured_output(schema, method=method, include_raw=True).invoke("Pick a digit.")
    assert out["parsing_error"] is None and out["raw"].usage_metadata["output_tokens"] > 0
    jsonschema.validate(out["parsed"], schema)


def test_langchain_json_mode_and_unknown_method(target):
    out = (
        _chat(target, max_tokens=200)
        .with_structured_output(None, method="json_mode", include_raw=True)
        .invoke("Reply in JSON.")
    )
    # json_mode: the reply is a JSON object unless cut short by max_tokens
    if out["raw"].response_metadata["finish_reason"] == "stop":
        assert isinstance(out["parsed"], dict)
    with pytest.raises(ValueError, match="method must be"):
        _chat(target).with_structured_output(Answer, method="xml")


def test_langchain_async_structured_output(target):
    llm = _chat(target).with_structured_output(Answer, method="json_schema")
    assert isinstance(asyncio.run(llm.ainvoke("Pick a digit.")), Answer)


# --- LlamaIndex ---------------------------------------------------------------------------------------


# LlamaIndex tools with bounded parameter types (a random model's free strings run past max_tokens)
class WeatherArgs(BaseModel):
    city: Literal["Rome", "Oslo"]


class CalcArgs(BaseModel):
    digit: Literal[1, 2, 3]
    negate: bool


def get_weather(city: str) -> str:
    """Get the current weather in a city."""
    return f"sunny in {city}"


def calculator(digit: int, negate: bool) -> str:
    """Negate a digit or not."""
    return str(-digit if negate else digit)


def test_llamaindex_structured_predict(target):
    from llama_index.core.prompts import PromptTemplate

    from agent_adapters.llamaindex import ChainKVLLM

    llm = ChainKVLLM(target=target, max_tokens=120, temperature=1.0, seed=5)
    out = llm.structured_predict(Answer, PromptTemplate("Pick a digit about {topic}."), topic="cats")
    assert isinstance(out, Answer) and 0 <= out.answer <= 9


def test_llamaindex_chat_with_tools_required_and_response_format(target):
    from llama_index.core.llms import ChatMessage
    from llama_index.core.tools import FunctionTool

    from agent_adapters.llamaindex import ChainKVLLM

    llm = ChainKVLLM(target=target, max_tokens=120, temperature=1.0, seed=9)
    tools = [
        FunctionTool.from_defaults(get_weather, fn_schema=WeatherArgs),
        FunctionTool.from_defaults(calculator, fn_schema=CalcArgs),
    ]
    response = llm.chat_with_tools(tools, user_msg="Weather in Rome?", tool_required=True)
    calls = llm.get_tool_calls_from_response(response)
    assert len(calls) == 1 and calls[0].tool_name in ("get_weather", "calculator")
    response = llm.chat_with_tools(tools, user_msg="Weather in Rome?", tool_choice="calculator")
    assert [c.tool_name for c in llm.get_tool_calls_from_response(response)] == ["calculator"]
    schema = Answer.model_json_schema()
    r = llm.chat(
        [ChatMessage(role="user", content="Pick a digit.")],
        response_format={"type": "json_schema", "json_schema": {"name": "Answer", "schema": schema}},
    )
    if r.raw["finish_reason"] == "stop":
        Answer.model_validate_json(r.message.content)
