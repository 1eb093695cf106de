"""The OpenAI-compatible HTTP front (sidecar/http/) against a live server on the tiny chat model (a
random llama with SmolLM2's tokenizer and chat template), driven by the official ``openai`` client and
raw httpx for the requests the client would refuse to send."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from tests.conftest import make_engine

TOKENS = {"tok-alpha": "alpha", "tok-beta": "beta"}
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}},
    "required": ["city"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "weather in a city", "parameters": WEATHER}}
]
FORCE = {"type": "function", "function": {"name": "get_weather"}}


class Live:
    """A sidecar (ServerThread) with its HTTP front, on one engine and one store."""

    def __init__(self, engine, store, **options):
        from sidecar.grpc.auth import Authenticator
        from sidecar.http.app import HttpFront, HttpOptions
        from sidecar.grpc.server import ServerOptions, ServerThread

        self.thread = ServerThread(engine, ServerOptions(port=0, auth=Authenticator(TOKENS), **options), store)
        self.thread.start()
        self.http = HttpFront(self.thread.server, HttpOptions(port=0))
        self.port = self.thread.run(self.http.start())
        self.url = f"http://127.0.0.1:{self.port}/v1"
        self.model = self.http.app.state.backend.model_name

    def client(self, token: str = "tok-alpha") -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url, api_key=token, max_retries=0, timeout=120)

    def stop(self) -> None:
        self.thread.run(self.http.stop())
        self.thread.stop(grace=2)


@pytest.fixture(scope="module")
def store_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("http-store")


@pytest.fixture(scope="module")
def engine(tiny_chat_dir):
    return make_engine(tiny_chat_dir, num_pages=6000, prefill_chunk_size=128, max_model_len=4096)


@pytest.fixture(scope="module")
def live(engine, store_dir):
    from sidecar.store import open_store

    server = Live(engine, open_store(str(store_dir)))
    yield server
    server.stop()


def _chat_round_trip(client, model, stream: bool):
    """Turn 1 forces a tool call, turn 2 answers it, turn 3 asks again: (usages, tool call)."""
    msgs = [{"role": "system", "content": "You help."}, {"role": "user", "content": "Weather in Oslo?"}]
    usages = []
    reply, usage = _complete(client, model, msgs, stream, tools=TOOLS, tool_choice=FORCE, max_tokens=96)
    usages.append(usage)
    assert reply["tool_calls"] and reply["tool_calls"][0]["function"]["name"] == "get_weather"
    call = reply["tool_calls"][0]
    jsonschema.validate(json.loads(call["function"]["arguments"]), WEATHER)
    msgs += [reply, {"role": "tool", "tool_call_id": call["id"], "content": '{"celsius": 4}'}]
    reply, usage = _complete(client, model, msgs, stream, tools=TOOLS, max_tokens=12)
    usages.append(usage)
    msgs += [reply, {"role": "user", "content": "And tomorrow?"}]
    _, usage = _complete(client, model, msgs, stream, tools=TOOLS, max_tokens=12)
    usages.append(usage)
    return usages


def _complete(client, model, msgs, stream, **kw):
    if not stream:
        r = client.chat.completions.create(model=model, messages=msgs, **kw)
        return r.choices[0].message.model_dump(exclude_none=True), r.usage
    text, calls, usage, finish = "", [], None, None
    for ch in client.chat.completions.create(
        model=model, messages=msgs, stream=True, stream_options={"include_usage": True}, **kw
    ):
        if ch.usage is not None:
            assert not ch.choices  # the usage chunk is the last one and has no choices
            usage = ch.usage
            continue
        d = ch.choices[0].delta
        text += d.content or ""
        calls += [c.model_dump(exclude_none=True) for c in d.tool_calls or []]
        finish = ch.choices[0].finish_reason or finish
    assert finish in ("stop", "length", "tool_calls") and usage is not None
    reply = {"role": "assistant", "content": text}
    if calls:
        reply["tool_calls"] = [{k: v for k, v in c.items() if k != "index"} for c in calls]
    return reply, usage


@pytest.mark.parametrize("stream", [False, True])
def test_three_turn_chat_with_a_tool_round_trip_reuses_the_cache(live, stream):
    usages = _chat_round_trip(live.client(), live.model, stream)
    # turn 1: at most the shared system prompt and tools (stored once for every session) were cached
    assert usages[0].prompt_tokens_details.cached_tokens < usages[0].prompt_tokens
    for before, u in zip(usages, usages[1:]):
        assert u.prompt_tokens_details.cached_tokens > 0
        assert u.prompt_tokens > before.prompt_tokens
        # everything but this turn's new messages was cached
        assert u.prompt_tokens_details.cached_tokens >= before.prompt_tokens + before.completion_tokens - 1


def test_prompt_cache_key_names_the_session_and_a_changed_history_restarts_it(live):
    c = live.client()
    msgs = [{"role": "user", "content": "count"}]
    r = c.chat.completions.create(model=live.model, messages=msgs, max_tokens=6, prompt_cache_key="my-thread")
    msgs += [r.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "on"}]
    r2 = c.chat.completions.create(model=live.model, messages=msgs, max_tokens=6, prompt_cache_key="my-thread")
    assert r2.usage.prompt_tokens_details.cached_tokens > 0
    edited = [{"role": "user", "content": "count differently"}, msgs[1], msgs[2]]
    r3 = c.chat.completions.create(model=live.model, messages=edited, max_tokens=6, prompt_cache_key="my-thread")
    assert r3.usage.prompt_tokens_details.cached_tokens == 0


def test_response_format_json_schema_validates(live):
    schema = {
        "type": "object",
        "properties": {
            "answer": {"type": "integer", "minimum": 0, "maximum": 99},
            "why": {"type": "string", "maxLength": 20},
        },
        "required": ["answer", "why"],
        "additionalProperties": False,
    }
    c = live.client()
    for i in range(3):
        r = c.chat.completions.create(
            model=live.model,
            messages=[{"role": "user", "content": f"a number please ({i})"}],
            max_tokens=80,
            temperature=0.8,
            seed=i,
            response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema}},
        )
        assert r.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(r.choices[0].message.content), schema)


def _responses_round_trip(c, model, stream: bool, previous: str | None = None):
    kw = dict(
        model=model, tools=[{"type": "function", "name": "get_weather", "parameters": WEATHER}], max_output_tokens=96
    )
    first = _respond(
        c,
        stream,
        input="Weather in Rome?",
        tool_choice={"type": "function", "name": "get_weather"},
        previous_response_id=previous,
        **kw,
    )
    calls = [o for o in first.output if o.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather"
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER)
    second = _respond(
        c,
        stream,
        previous_response_id=first.id,
        **kw,
        input=[{"type": "function_call_output", "call_id": calls[0].call_id, "output": '{"celsius": 20}'}],
    )
    third = _respond(c, stream, previous_response_id=second.id, input="Thanks!", **kw)
    return [first, second, third]


def _respond(c, stream, **kw):
    kw = {k: v for k, v in kw.items() if v is not None}
    if not stream:
        return c.responses.create(**kw)
    kinds, final = [], None
    with c.responses.stream(**kw) as s:
        for ev in s:
            kinds.append(ev.type)
            if ev.type in ("response.completed", "response.incomplete"):
                final = ev.response
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    return final


@pytest.mark.parametrize("stream", [False, True])
def test_responses_api_chain_with_previous_response_id(live, stream):
    c = live.client()
    rs = _responses_round_trip(c, live.model, stream)
    assert rs[0].usage.input_tokens_details.cached_tokens < rs[0].usage.input_tokens  # at most the shared prefix
    for before, r in zip(rs, rs[1:]):
        assert r.usage.input_tokens_details.cached_tokens >= before.usage.input_tokens + before.usage.output_tokens - 1
    got = c.responses.retrieve(rs[1].id)
    assert got.id == rs[1].id and got.output_text == rs[1].output_text
    # only the latest response continues its conversation
    with pytest.raises(openai.BadRequestError):
        c.responses.create(model=live.model, input="branch", previous_response_id=rs[0].id, max_output_tokens=4)
    c.responses.delete(rs[2].id)
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve(rs[2].id)


def test_store_false_keeps_nothing_and_conversation_names_the_session(live):
    c = live.client()
    r = c.responses.create(model=live.model, input="ephemeral", store=False, max_output_tokens=4)
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve(r.id)
    a = c.responses.create(model=live.model, input="one", conversation="conv-http-1", max_output_tokens=4)
    b = c.responses.create(model=live.model, input="two", conversation="conv-http-1", max_output_tokens=4)
    assert a.usage.input_tokens_details.cached_tokens == 0 and b.usage.input_tokens_details.cached_tokens > 0


def test_tenants_are_isolated(live):
    alpha, beta = live.client("tok-alpha"), live.client("tok-beta")
    r = alpha.responses.create(model=live.model, input="secret", max_output_tokens=4)
    with pytest.raises(openai.NotFoundError):
        beta.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError):
        beta.responses.create(model=live.model, input="x", previous_response_id=r.id, max_output_tokens=4)
    with pytest.raises(openai.NotFoundError):
        beta.responses.delete(r.id)
    assert alpha.responses.retrieve(r.id).id == r.id
    # the same conversation from another tenant never finds alpha's cached session
    msgs = [{"role": "user", "content": "shared words"}]
    first = alpha.chat.completions.create(model=live.model, messages=msgs, max_tokens=5)
    msgs += [first.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "more"}]
    assert (
        beta.chat.completions.create(
            model=live.model, messages=msgs, max_tokens=5
        ).usage.prompt_tokens_details.cached_tokens
        == 0
    )
    assert (
        alpha.chat.completions.create(
            model=live.model, messages=msgs, max_tokens=5
        ).usage.prompt_tokens_details.cached_tokens
        > 0
    )


HOSTILE = [
    (b"{not json", 400, None),
    (b"[1, 2]", 400, None),
    (json.dumps({"messages": [{"role": "user", "content": "x"}]}).encode(), 400, "model"),
    (json.dumps({"model": "gpt-4o", "messages": [{"role": "user", "content": "x"}]}).encode(), 404, "model"),
    (b'{"model": "M", "messages": [{"role": "user", "content": "x"}], "temperature": NaN}', 400, "temperature"),
    (b'{"model": "M", "messages": [{"role": "user", "content": "x"}], "top_p": Infinity}', 400, "top_p"),
    (json.dumps({"model": "M", "messages": [{"role": "user", "content": "x"}], "n": 10**9}).encode(), 400, "n"),
    (
        b'{"model": "M", "messages": [{"role": "user", "content": "x"}], "presence_penalty": NaN}',
        400,
        "presence_penalty",
    ),
    (
        json.dumps({"model": "M", "messages": [{"role": "user", "content": "x"}], "frequency_penalty": -2.5}).encode(),
        400,
        "frequency_penalty",
    ),
    (
        json.dumps({"model": "M", "messages": [{"role": "user", "content": "x"}], "frequency_penalty": "1"}).encode(),
        400,
        "frequency_penalty",
    ),
    (
        json.dumps(
            {"model": "M", "messages": [{"role": "user", "content": "x"}], "repetition_penalty": 1e-300}
        ).encode(),
        400,
        "repetition_penalty",
    ),
    (
        b'{"model": "M", "messages": [{"role": "user", "content": "x"}], "repetition_penalty": Infinity}',
        400,
        "repetition_penalty",
    ),
    (
        json.dumps({"model": "M", "messages": [{"role": "user", "content": "x"}], "max_tokens": 10**12}).encode(),
        400,
        "max_tokens",
    ),
    (
        json.dumps({"model": "M", "messages": [{"role": "user", "content": "x"}], "temperature": "hot"}).encode(),
        400,
        "temperature",
    ),
    (json.dumps({"model": "M", "messages": [{"role": "wizard", "content": "x"}]}).encode(), 400, "messages"),
    (json.dumps({"model": "M", "messages": []}).encode(), 400, "messages"),
    (
        json.dumps({"model": "M", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}).encode(),
        400,
        "messages[0]",
    ),
    (json.dumps({"model": "M", "messages": [{"role": "user", "content": "x"}], "tools": "all"}).encode(), 400, "tools"),
    (
        json.dumps(
            {
                "model": "M",
                "messages": [{"role": "user", "content": "x"}],
                "response_format": {"type": "json_schema", "json_schema": {"schema": "nope"}},
            }
        ).encode(),
        400,
        "response_format",
    ),
    (
        json.dumps(
            {
                "model": "M",
                "messages": [{"role": "user", "content": "x"}],
                "tools": TOOLS,
                "tool_choice": {"type": "function", "function": {"name": "missing"}},
            }
        ).encode(),
        400,
        None,
    ),
    (
        json.dumps(
            {"model": "M", "messages": [{"role": "user", "content": "x"}], "chainkv": {"method": "no-such-method"}}
        ).encode(),
        400,
        None,
    ),
    (
        json.dumps(
            {
                "model": "M",
                "messages": [{"role": "user", "content": "x"}],
                "chainkv": {"method": "snapkv", "budget": -5},
            }
        ).encode(),
        400,
        "chainkv",
    ),
    (b'{"model": "M", "messages": ' + b"[" * 100000 + b"]" * 100000 + b"}", 400, None),
    (b'{"model": "M", "messages": [{"role": "user", "content": "' + b"x" * (5 * 2**20) + b'"}]}', 413, None),
]


@pytest.mark.parametrize("raw, status, param", HOSTILE)
def test_hostile_requests_get_openai_errors(live, raw, status, param):
    raw = raw.replace(b'"model": "M"', f'"model": "{live.model}"'.encode())
    r = httpx.post(
        f"{live.url}/chat/completions",
        content=raw,
        timeout=60,
        headers={"Authorization": "Bearer tok-alpha", "Content-Type": "application/json"},
    )
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert (err["param"] or "").startswith(param) or param in err["message"]


def test_penalties_reach_the_engine_on_both_apis(live):
    c = live.client()
    msgs = [{"role": "user", "content": "Say something long."}]
    plain = c.chat.completions.create(model=live.model, messages=msgs, max_tokens=24)
    penalized = [
        c.chat.completions.create(model=live.model, messages=msgs, max_tokens=24, frequency_penalty=2.0),
        c.chat.completions.create(model=live.model, messages=msgs, max_tokens=24, presence_penalty=2.0),
        c.chat.completions.create(
            model=live.model, messages=msgs, max_tokens=24, extra_body={"repetition_penalty": 100.0}
        ),
    ]
    for r in penalized:
        assert r.choices[0].message.content != plain.choices[0].message.content
    plain_r = c.responses.create(model=live.model, input="Say something long.", max_output_tokens=24, store=False)
    pen_r = c.responses.create(
        model=live.model,
        input="Say something long.",
        max_output_tokens=24,
        store=False,
        extra_body={"frequency_penalty": 2.0},
    )
    assert pen_r.output_text != plain_r.output_text


def test_auth_errors_and_the_server_keeps_serving(live):
    with pytest.raises(openai.AuthenticationError):
        live.client("tok-wrong").models.list()
    r = httpx.get(f"{live.url}/models", timeout=30)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    r = httpx.get(f"{live.url}/responses/resp_bm9wZQ.0", headers={"Authorization": "Bearer tok-alpha"}, timeout=30)
    assert r.status_code == 404 and r.json()["error"]["code"] == "response_not_found"
    assert live.client().models.list().data[0].id == live.model
    ok = live.client().chat.completions.create(
        model=live.model, messages=[{"role": "user", "content": "ok?"}], max_tokens=3
    )
    assert ok.usage.completion_tokens >= 1


def test_a_stream_closed_early_releases_its_session(live):
    c = live.client()
    msgs = [{"role": "user", "content": "long story"}]
    with c.chat.completions.create(
        model=live.model,
        messages=msgs,
        max_tokens=400,
        stream=True,
        prompt_cache_key="dropped",
        extra_body={"ignore_eos": True},
    ) as s:
        next(iter(s))
    for _ in range(20):  # the same session takes a turn at once (the dropped turn was rolled back)
        try:
            r = c.chat.completions.create(model=live.model, messages=msgs, max_tokens=3, prompt_cache_key="dropped")
            break
        except openai.ConflictError:
            import time

            time.sleep(0.1)
    assert r.choices[0].message is not None


def test_responses_resume_after_a_restart_on_the_same_store(engine, store_dir, live):
    """A response id resolves on another server sharing the store: its session comes back from the snapshot."""
    from sidecar.store import open_store

    c = live.client()
    first = c.responses.create(model=live.model, input="remember me", max_output_tokens=6)
    assert live.thread.run(live.thread.server.writer.flush(30))
    other = Live(
        make_engine(engine.model_dir, num_pages=6000, prefill_chunk_size=128, max_model_len=4096),
        open_store(str(store_dir)),
    )
    try:
        c2 = other.client()
        assert c2.responses.retrieve(first.id).output_text == first.output_text
        nxt = c2.responses.create(
            model=other.model, input="and now?", previous_response_id=first.id, max_output_tokens=6
        )
        assert nxt.usage.input_tokens_details.cached_tokens > 0
    finally:
        other.stop()


def test_langchain_chat_openai_tools_structured_output_and_cache(live):
    """LangChain's ChatOpenAI pointed at the front: a forced tool call, structured output by json_schema,
    and a conversation whose second call reuses the cache."""
    lc = pytest.importorskip("langchain_openai")
    from langchain_core.messages import HumanMessage
    from pydantic import BaseModel, Field

    class Answer(BaseModel):
        answer: int = Field(ge=0, le=9)
        sure: bool

    llm = lc.ChatOpenAI(
        base_url=live.url, api_key="tok-alpha", model=live.model, max_tokens=96, max_retries=0, stream_usage=True
    )
    msg = llm.bind_tools(TOOLS, tool_choice="get_weather").invoke(
        "Weather in Oslo?"
    )  # (a random model needs maxLength)
    assert len(msg.tool_calls) == 1 and msg.tool_calls[0]["name"] == "get_weather"
    assert isinstance(msg.tool_calls[0]["args"].get("city"), str)
    parsed = llm.with_structured_output(Answer, method="json_schema").invoke("Pick a digit.")
    assert isinstance(parsed, Answer)
    history = [HumanMessage("Tell me something.")]
    history.append(llm.invoke(history))
    history.append(HumanMessage("More."))
    second = llm.invoke(history)
    assert second.usage_metadata["input_token_details"]["cache_read"] > 0


@pytest.mark.slow
def test_chainkv_serve_http_port_serves_both_fronts(tiny_chat_dir, tmp_path):
    """``chainkv serve --http-port 0``: one process answers gRPC and HTTP on the same sessions, and a
    SIGTERM drains and exits cleanly."""
    import os
    import signal
    import subprocess
    import sys
    import threading
    from pathlib import Path

    import grpc

    from sidecar._proto.chainkv.v1 import sidecar_pb2 as pb
    from sidecar._proto.chainkv.v1 import sidecar_pb2_grpc

    root = Path(__file__).resolve().parents[1]
    cmd = [
        sys.executable,
        "-m",
        "sidecar.cli",
        "serve",
        "--port",
        "0",
        "--http-port",
        "0",
        "--device",
        "cpu",
        "--model",
        tiny_chat_dir,
        "--store",
        str(tmp_path / "store"),
        "--num-pages",
        "3000",
        "--max-model-len",
        "2048",
        "--log-level",
        "WARNING",
        "--auth-token",
        "tok-alpha=alpha",
    ]
    env = dict(os.environ, PYTHONPATH=str(root), OMP_NUM_THREADS="1")
    proc = subprocess.Popen(cmd, cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    ports: dict[str, int] = {}
    ready = threading.Event()

    def read():
        for line in proc.stdout:
            if "serving chainkv.v1.Sidecar on" in line:
                ports["grpc"] = int(line.split(" on ", 1)[1].split()[0].rsplit(":", 1)[1])
            if "OpenAI-compatible HTTP API on http://" in line:
                ports["http"] = int(line.split("http://", 1)[1].split("/", 1)[0].rsplit(":", 1)[1])
                ready.set()

    threading.Thread(target=read, daemon=True).start()
    try:
        assert ready.wait(300), "the server did not start"
        c = openai.OpenAI(base_url=f"http://127.0.0.1:{ports['http']}/v1", api_key="tok-alpha", max_retries=0)
        model = c.models.list().data[0].id
        r = c.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=4, prompt_cache_key="both-fronts"
        )
        assert r.usage.completion_tokens >= 1
        # the HTTP session is the tenant's gRPC session pck-both-fronts
        stub = sidecar_pb2_grpc.SidecarStub(grpc.insecure_channel(f"127.0.0.1:{ports['grpc']}"))
        info = stub.GetSession(
            pb.GetSessionRequest(session_id="pck-both-fronts"),
            timeout=60,
            metadata=[("authorization", "Bearer tok-alpha")],
        )
        assert info.turn_index == 1
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(120) == 0
