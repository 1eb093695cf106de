"""What real OpenAI clients ask of the HTTP front beyond plain chat (issue 30), against a live server on the
tiny chat model (a random llama with SmolLM2's tokenizer and chat template):

* the Responses API with ``text.format`` json_schema, streamed and not, through ``client.responses.parse``
  and LangChain's ``ChatOpenAI(use_responses_api=True).with_structured_output``;
* under ``tool_choice`` auto only a declared tool is called: a reply that calls any other name is text,
  on both APIs, streamed and not (the reply is scripted by a grammar, so the model's choice is fixed);
* a 400 names the request's own field, never a native library's source path.
"""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest
from pydantic import BaseModel, Field
from test_http_front import TOOLS, Live, _complete

from tests.conftest import make_engine

PICK = {
    "type": "object",
    "properties": {"answer": {"type": "integer", "minimum": 0, "maximum": 9}, "sure": {"type": "boolean"}},
    "required": ["answer", "sure"],
    "additionalProperties": False,
}
UNDECLARED = '<tool_call>\n{"name": "delete_everything", "arguments": {"path": "/"}}\n</tool_call>'


class Pick(BaseModel):
    answer: int = Field(ge=0, le=9)
    sure: bool


@pytest.fixture(scope="module")
def live(tiny_chat_dir, tmp_path_factory):
    from sidecar.store import open_store

    engine = make_engine(tiny_chat_dir, num_pages=3000, prefill_chunk_size=128, max_model_len=2048)
    server = Live(engine, open_store(str(tmp_path_factory.mktemp("http-structured-store"))))
    yield server
    server.stop()


@pytest.mark.parametrize("stream", [False, True])
def test_responses_text_format_json_schema(live, stream):
    c = live.client()
    kw = dict(
        model=live.model,
        input="Pick a digit.",
        max_output_tokens=40,
        text={"format": {"type": "json_schema", "name": "pick", "schema": PICK, "strict": True}},
    )
    if stream:
        with c.responses.stream(**kw) as s:
            kinds = [ev.type for ev in s]
            r = s.get_final_response()
        assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    else:
        r = c.responses.create(**kw)
    assert r.status == "completed"
    jsonschema.validate(json.loads(r.output_text), PICK)
    assert r.text.format.type == "json_schema" and r.text.format.schema_ == PICK  # echoed under its own key
    assert c.responses.retrieve(r.id).text.format.schema_ == PICK


def test_responses_parse_with_a_pydantic_model(live):
    r = live.client().responses.parse(model=live.model, input="Pick a digit.", text_format=Pick, max_output_tokens=40)
    assert isinstance(r.output_parsed, Pick)


@pytest.mark.parametrize("stream", [False, True])
def test_langchain_structured_output_over_the_responses_api(live, stream):
    lc = pytest.importorskip("langchain_openai")
    llm = lc.ChatOpenAI(
        base_url=live.url,
        api_key="tok-alpha",
        model=live.model,
        max_tokens=40,
        max_retries=0,
        use_responses_api=True,
        streaming=stream,
    )
    assert isinstance(llm.with_structured_output(Pick, method="json_schema").invoke("Pick a digit."), Pick)


@pytest.fixture
def scripted(monkeypatch):
    """``scripted(text)``: every turn's reply is ``text`` (a grammar that allows nothing else), under
    whatever ``tool_choice`` the request gives: what a model could write, made deterministic."""
    from engine.constrained import Constraint
    from sidecar.turns.structured import OutputSpec

    def script(text: str) -> None:
        grammar = Constraint("grammar", "root ::= " + json.dumps(text))
        monkeypatch.setattr(OutputSpec, "constraint", lambda self, tools: grammar)

    return script


@pytest.mark.parametrize("stream", [False, True])
def test_chat_completions_under_auto_call_only_declared_tools(live, scripted, stream):
    scripted(UNDECLARED)
    msgs = [{"role": "user", "content": "Weather in Oslo?"}]
    reply, _ = _complete(live.client(), live.model, msgs, stream, tools=TOOLS, tool_choice="auto", max_tokens=60)
    assert "tool_calls" not in reply and reply["content"] == UNDECLARED
    scripted(UNDECLARED.replace("delete_everything", "get_weather"))  # a declared tool is a call
    reply, _ = _complete(live.client(), live.model, msgs, stream, tools=TOOLS, tool_choice="auto", max_tokens=60)
    assert [t["function"]["name"] for t in reply["tool_calls"]] == ["get_weather"]


@pytest.mark.parametrize("stream", [False, True])
def test_responses_under_auto_call_only_declared_tools(live, scripted, stream):
    scripted(UNDECLARED)
    c = live.client()
    kw = dict(
        model=live.model,
        input="Weather in Oslo?",
        tools=[{"type": "function", "name": "get_weather", "parameters": TOOLS[0]["function"]["parameters"]}],
        tool_choice="auto",
        max_output_tokens=60,
    )
    if stream:
        with c.responses.stream(**kw) as s:
            added = [ev.item.type for ev in s if ev.type == "response.output_item.added"]
            r = s.get_final_response()
        assert added == ["message"]
    else:
        r = c.responses.create(**kw)
    assert [o.type for o in r.output] == ["message"] and r.output_text == UNDECLARED


def _post(live, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{live.url}/{path}", json=body, timeout=60, headers={"Authorization": "Bearer tok-alpha"})


BAD_TYPE = {"type": "object", "properties": {"a": {"type": "foo"}}, "required": ["a"]}


@pytest.mark.parametrize(
    "path, body, param, needle",
    [
        (
            "chat/completions",
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": BAD_TYPE}}},
            "response_format",
            'Unsupported type "foo"',
        ),
        (
            "responses",
            {"text": {"format": {"type": "json_schema", "name": "x", "schema": BAD_TYPE}}},
            "text.format",
            'Unsupported type "foo"',
        ),
        (
            "chat/completions",
            {
                "tools": [{"type": "function", "function": {"name": "f", "parameters": BAD_TYPE}}],
                "tool_choice": "required",
            },
            "tools",
            'Unsupported type "foo"',
        ),
        (
            "chat/completions",
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "missing"}}},
            "tool_choice",
            "not one of the tools",
        ),
        ("responses", {"previous_response_id": "not-a-response-id"}, "previous_response_id", "not-a-response-id"),
    ],
)
def test_errors_name_the_request_field_and_no_library_internals(live, path, body, param, needle):
    prompt = {"messages": [{"role": "user", "content": "x"}]} if path == "chat/completions" else {"input": "x"}
    r = _post(
        live, path, {"model": live.model, "max_tokens" if "chat" in path else "max_output_tokens": 8, **prompt, **body}
    )
    assert r.status_code in (400, 404), r.text
    err = r.json()["error"]
    assert err["param"] == param and needle in err["message"], err
    assert ".cc" not in err["message"] and "/project" not in err["message"], err
