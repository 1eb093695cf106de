"""The agent adapters against a real sidecar over real gRPC, on SmolLM2 (CPU, greedy, short turns).

One in-process sidecar (``ServerThread`` on the shared ``smol_engine``, so the engine's counters
can be read) serves the Python client, the LangChain ``ChatChainKV`` and the LlamaIndex
``ChainKVLLM``. Shown here: streaming through both adapters; session continuity (later turns
send only the new messages and reuse the cached KV); async variants; a tool-call round trip; a
stream broken after its first tokens retried with the same request_id without running the turn
twice (through a TCP proxy that drops the client's connection).

Tool calls: SmolLM2-135M seldom decides to call a tool by itself. The tool-call tests ask it to
reply with the call's markup (``<tool_call>{...}</tool_call>``) verbatim, which it does under
greedy decoding. The markup is the model's own output: it streams through the sidecar's tool-call
parser, comes back as a structured call (``AIMessage.tool_calls``, ``ToolCallBlock``), the tool
result goes back as a ``tool`` message on the cached session, and the model answers (the tool's
output ends with a hint to answer in words: without it SmolLM2 repeats the call).
"""

from __future__ import annotations

import asyncio

import grpc
import pytest

from tcp_proxy import TcpProxy

pytest.importorskip("langchain_core")
pytest.importorskip("llama_index.core")

from agent_adapters.client import AsyncChainKVClient, ChainKVClient, ChainKVError, RetryPolicy  # noqa: E402
from agent_adapters.messages import TextDelta, ToolCall, TurnResult  # noqa: E402

pytestmark = pytest.mark.slow

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
CALL_PROMPT = (
    "Reply with exactly this line and nothing else: "
    '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
)
ANSWER_HINT = "Now describe the weather in one sentence, without calling a tool."
SYSTEM = "You are a concise assistant."


@pytest.fixture(scope="module")
def sidecar(smol_engine):
    from sidecar.grpc.server import ServerOptions, ServerThread

    server = ServerThread(smol_engine, ServerOptions(port=0))
    port = server.start()
    yield server, f"127.0.0.1:{port}"
    server.stop(grace=2)
    for sid in list(smol_engine.chains.chains):
        smol_engine.end_session(sid)


def session_of(target: str, session_id: str):
    with ChainKVClient(target) as c:
        return c.get_session(session_id)


# --- the client ----------------------------------------------------------------------------------


def test_client_streams_then_continues_the_session_and_reports_server_info(sidecar, smol_engine):
    _, target = sidecar
    with ChainKVClient(target) as c:
        info = c.server_info()
        assert info.max_model_len == smol_engine.max_model_len and "dense" in info.methods
        events = list(
            c.stream_turn(
                "cl-1",
                [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Name a fruit."}],
                max_tokens=8,
            )
        )
        deltas = [e for e in events if isinstance(e, TextDelta)]
        first = events[-1]
        assert isinstance(first, TurnResult) and len(deltas) >= 2
        assert "".join(d.text for d in deltas) == first.text
        assert [t for d in deltas for t in d.token_ids] == list(first.token_ids)
        second = c.turn("cl-1", [{"role": "user", "content": "Another one?"}], max_tokens=8)
        assert second.turn_index == 1 and second.usage.source_tier == "gpu"
        assert 0 < second.usage.reused_tokens <= first.usage.history_tokens
        assert second.usage.history_tokens == first.usage.history_tokens + second.usage.prompt_tokens + 8
        with pytest.raises(ChainKVError) as e:
            c.turn("cl-1", [{"role": "wizard", "content": "x"}])
        assert e.value.code is grpc.StatusCode.INVALID_ARGUMENT and e.value.attempts == 1  # not retried


def test_a_deadline_stops_the_turn_and_is_not_retried(sidecar):
    _, target = sidecar
    with ChainKVClient(target) as c:
        with pytest.raises(ChainKVError) as e:
            c.turn(
                "cl-deadline",
                [{"role": "user", "content": "Count to one thousand."}],
                max_tokens=400,
                ignore_eos=True,
                timeout_s=0.5,
            )
        assert e.value.code is grpc.StatusCode.DEADLINE_EXCEEDED and e.value.attempts == 1


@pytest.mark.parametrize("keep_upstream", [True, False], ids=["server-keeps-running", "server-sees-the-drop"])
def test_a_stream_dropped_after_its_first_tokens_is_retried_without_running_the_turn_twice(
    sidecar, smol_engine, keep_upstream
):
    """The proxy drops the client's connection right after the first delta. Either the server
    never notices (a partition) and finishes the turn: the retry, same request_id, is answered
    from its idempotency record (replayed); or it notices, cancels and rolls the turn back: the
    retry runs it once. Either way the caller sees one uninterrupted reply and the session holds
    the turn once."""
    server, target = sidecar
    proxy = TcpProxy(int(target.rsplit(":", 1)[1]))
    sid = f"drop-{keep_upstream}"
    server.call(lambda: None)
    while server.run(_engine_busy(server)):  # earlier tests' aborted turns settle first
        pass
    decoded_before = smol_engine.totals["decoded_tokens"]
    try:
        with ChainKVClient(proxy.target, retry=RetryPolicy(max_attempts=8, initial_backoff_s=0.05)) as c:
            events = []
            for event in c.stream_turn(
                sid,
                [{"role": "user", "content": "Tell me about the sea."}],
                max_tokens=32,
                ignore_eos=True,
                request_id="req-1",
            ):
                events.append(event)
                if len(events) == 1:
                    assert proxy.cut(keep_upstream=keep_upstream) == 1
            result = events[-1]
            assert isinstance(result, TurnResult) and result.attempts >= 2 and proxy.connections >= 2
            assert "".join(e.text for e in events if isinstance(e, TextDelta)) == result.text
            assert [t for e in events if isinstance(e, TextDelta) for t in e.token_ids] == list(result.token_ids)
            assert len(result.token_ids) == 32 and result.turn_index == 0
            if keep_upstream:
                assert result.replayed
                assert smol_engine.totals["decoded_tokens"] - decoded_before == 32  # the engine ran it once
            s = c.get_session(sid)
            assert s.turn_index == 1 and s.history_tokens == result.usage.history_tokens
            again = c.turn(
                sid,
                [{"role": "user", "content": "Tell me about the sea."}],
                max_tokens=32,
                ignore_eos=True,
                request_id="req-1",
            )  # a late duplicate
            assert again.replayed and again.text == result.text and c.get_session(sid).turn_index == 1
            with pytest.raises(ChainKVError) as e:  # the same request_id for another request is refused
                c.turn(sid, [{"role": "user", "content": "x"}], request_id="req-1")
            assert e.value.code is grpc.StatusCode.FAILED_PRECONDITION and c.get_session(sid).turn_index == 1
    finally:
        proxy.close()


async def _engine_busy(server) -> bool:
    await asyncio.sleep(0.05)
    return bool(server.server.sessions.active_turns or server.server.turns.settling)


# --- LangChain -----------------------------------------------------------------------------------


def test_langchain_streams_and_continues_the_thread_with_only_new_messages(sidecar):
    from langchain_core.messages import AIMessageChunk, HumanMessage, SystemMessage

    from agent_adapters.langchain import ChatChainKV

    _, target = sidecar
    llm = ChatChainKV(target=target, max_tokens=8)
    cfg = {"configurable": {"thread_id": "lc-thread"}}
    history = [SystemMessage(SYSTEM), HumanMessage("Name a color.")]
    chunks = list(llm.stream(history, config=cfg))
    assert len([c for c in chunks if c.content]) >= 2
    reply = sum(chunks[1:], chunks[0])
    assert isinstance(reply, AIMessageChunk) and reply.content
    first = reply.response_metadata
    assert first["session_id"] == "lc-thread" and first["turn_index"] == 0
    history += [reply, HumanMessage("Name another color.")]
    second = llm.invoke(history, config=cfg)
    u = second.response_metadata["chainkv_usage"]
    assert second.response_metadata["turn_index"] == 1 and u["reused_tokens"] > 0
    # only the new user message was sent: the history grew by it and the reply, nothing was re-sent
    assert u["history_tokens"] == first["chainkv_usage"]["history_tokens"] + u["prompt_tokens"] + u["generated_tokens"]
    assert second.usage_metadata["input_token_details"]["cache_read"] == u["reused_tokens"]
    history += [second, HumanMessage("And a third?")]
    third = llm.invoke(history, config=cfg)
    assert third.response_metadata["turn_index"] == 2 and third.response_metadata["chainkv_usage"]["reused_tokens"] > 0
    assert session_of(target, "lc-thread").turn_index == 3
    # an edited history cannot continue the session: it moves to a fresh one, with the whole history
    edited = llm.invoke([SystemMessage(SYSTEM), HumanMessage("Name a fruit.")], config=cfg)
    assert (
        edited.response_metadata["session_id"].startswith("lc-thread~") and edited.response_metadata["turn_index"] == 0
    )


def test_langchain_async_invoke_and_stream(sidecar):
    from langchain_core.messages import HumanMessage

    from agent_adapters.langchain import ChatChainKV

    _, target = sidecar
    llm = ChatChainKV(target=target, max_tokens=8, session_id="lc-async")

    async def main():
        history = [HumanMessage("Name an animal.")]
        first = await llm.ainvoke(history)
        history += [first, HumanMessage("Another?")]
        chunks = [c async for c in llm.astream(history)]
        return first, chunks

    first, chunks = asyncio.run(main())
    assert first.content and first.response_metadata["turn_index"] == 0
    reply = sum(chunks[1:], chunks[0])
    assert len([c for c in chunks if c.content]) >= 1 and reply.content
    assert reply.response_metadata["turn_index"] == 1 and reply.response_metadata["chainkv_usage"]["reused_tokens"] > 0


def test_langchain_tool_call_round_trip(sidecar):
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool

    from agent_adapters.langchain import ChatChainKV

    @tool
    def get_weather(city: str) -> str:
        """Get the current weather in a city."""
        return f"Rainy, 12 C in {city}. {ANSWER_HINT}"

    _, target = sidecar
    llm = ChatChainKV(target=target, max_tokens=40).bind_tools([get_weather])
    cfg = {"configurable": {"thread_id": "lc-tools"}}
    history = [HumanMessage(CALL_PROMPT)]
    chunks = list(llm.stream(history, config=cfg))
    call_msg = sum(chunks[1:], chunks[0])
    assert call_msg.tool_calls == [
        {"name": "get_weather", "args": {"city": "Paris"}, "id": "call_0_0", "type": "tool_call"}
    ]
    assert "<tool_call>" not in call_msg.content
    assert call_msg.response_metadata["finish_reason"] == "tool_calls"
    result = get_weather.invoke(call_msg.tool_calls[0])
    assert isinstance(result, ToolMessage) and result.tool_call_id == "call_0_0"
    history += [call_msg, result]
    answer = llm.invoke(history, config=cfg)
    u = answer.response_metadata["chainkv_usage"]
    assert answer.content and not answer.tool_calls and answer.response_metadata["turn_index"] == 1
    assert u["reused_tokens"] > 0 and u["prompt_tokens"] < u["reused_tokens"]  # only the tool result was sent


# --- LlamaIndex ------------------------------------------------------------------------------------


def test_llamaindex_metadata_chat_and_stream_chat_continue_the_session(sidecar, smol_engine):
    from llama_index.core.base.llms.types import ChatMessage

    from agent_adapters.llamaindex import ChainKVLLM

    _, target = sidecar
    llm = ChainKVLLM(target=target, session_id="li-1", max_tokens=8)
    meta = llm.metadata
    assert meta.context_window == smol_engine.max_model_len and meta.num_output == 8
    assert meta.is_chat_model and meta.is_function_calling_model and meta.model_name == smol_engine.model_dir.name
    history = [ChatMessage(role="system", content=SYSTEM), ChatMessage(role="user", content="Name a fruit.")]
    first = llm.chat(history)
    assert first.message.content and first.raw["turn_index"] == 0
    history += [first.message, ChatMessage(role="user", content="Another one?")]
    stream = list(llm.stream_chat(history))
    assert len([r for r in stream if r.delta]) >= 2
    assert "".join(r.delta for r in stream) == stream[-1].message.content
    last = stream[-1].raw
    assert last["turn_index"] == 1 and last["usage"]["reused_tokens"] > 0 and last["usage"]["source_tier"] == "gpu"
    done = llm.complete("Say hello.")  # stateless: its own throwaway session
    assert done.text and done.raw["session_id"].startswith("eph-")
    assert session_of(target, "li-1").turn_index == 2


def test_llamaindex_async_chat_and_stream_chat(sidecar):
    from llama_index.core.base.llms.types import ChatMessage

    from agent_adapters.llamaindex import ChainKVLLM

    _, target = sidecar
    llm = ChainKVLLM(target=target, session_id="li-async", max_tokens=8)

    async def main():
        history = [ChatMessage(role="user", content="Name a planet.")]
        first = await llm.achat(history)
        history += [first.message, ChatMessage(role="user", content="Another?")]
        stream = [r async for r in await llm.astream_chat(history)]
        done = await llm.acomplete("Say hi.")
        return first, stream, done

    first, stream, done = asyncio.run(main())
    assert first.message.content and first.raw["turn_index"] == 0
    assert "".join(r.delta for r in stream) == stream[-1].message.content
    assert stream[-1].raw["turn_index"] == 1 and stream[-1].raw["usage"]["reused_tokens"] > 0
    assert done.text


def test_llamaindex_tool_call_round_trip(sidecar):
    from llama_index.core.base.llms.types import ChatMessage
    from llama_index.core.tools import FunctionTool

    from agent_adapters.llamaindex import ChainKVLLM

    def get_weather(city: str) -> str:
        """Get the current weather in a city."""
        return f"Rainy, 12 C in {city}. {ANSWER_HINT}"

    tool = FunctionTool.from_defaults(fn=get_weather)
    _, target = sidecar
    llm = ChainKVLLM(target=target, session_id="li-tools", max_tokens=40)
    history: list[ChatMessage] = []
    response = llm.chat_with_tools([tool], user_msg=CALL_PROMPT, chat_history=history)
    calls = llm.get_tool_calls_from_response(response)
    assert [(c.tool_id, c.tool_name, c.tool_kwargs) for c in calls] == [("call_0_0", "get_weather", {"city": "Paris"})]
    output = tool.call(**calls[0].tool_kwargs)
    history += [
        ChatMessage(role="user", content=CALL_PROMPT),
        response.message,
        ChatMessage(
            role="tool",
            content=str(output),
            additional_kwargs={"tool_call_id": calls[0].tool_id, "name": "get_weather"},
        ),
    ]
    answer = llm.chat(history)
    assert answer.message.content and answer.raw["turn_index"] == 1 and answer.raw["usage"]["reused_tokens"] > 0
    assert not llm.get_tool_calls_from_response(answer, error_on_no_tool_call=False)


def test_async_client_streams_and_sessions_are_ordered(sidecar):
    _, target = sidecar

    async def main():
        async with AsyncChainKVClient(target) as c:
            events = [
                e async for e in c.stream_turn("acl-1", [{"role": "user", "content": "Name a fruit."}], max_tokens=6)
            ]
            second = await c.turn("acl-1", [{"role": "user", "content": "Another?"}], max_tokens=6)
            return events, second

    events, second = asyncio.run(main())
    assert isinstance(events[-1], TurnResult) and any(isinstance(e, TextDelta) for e in events)
    assert not any(isinstance(e, ToolCall) for e in events)
    assert second.turn_index == 1 and second.usage.reused_tokens > 0


# --- the examples ----------------------------------------------------------------------------------


def _example(name: str):
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "examples" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"example_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_examples_run_against_the_sidecar(sidecar):
    _, target = sidecar
    lines: list[str] = []
    history = _example("langchain_agent").run(
        target, questions=["What is 2 + 3?", "Thanks."], max_tokens=12, thread_id="ex-lc", out=lines.append
    )
    answers = [line for line in lines if line.startswith("assistant:")]
    assert len(answers) >= 2 and "reused]" in answers[-1] and " 0 reused]" not in answers[-1]
    assert session_of(target, "ex-lc").turn_index == len([m for m in history if m.type == "ai"])
    llm = _example("llamaindex_chat").run(
        target, questions=["Hi!", "Name a color."], max_tokens=8, session_id="ex-li", out=lines.append
    )
    assert session_of(target, llm.session_id).turn_index == 2  # the chat engine's second message continued the session
