"""The adapters' session lifecycle against a real sidecar (a tiny random model with SmolLM2's
tokenizer): a Turn that meets a busy session (ABORTED, "a turn is already running") is retried with
backoff until it runs; a conversation whose history was edited moves to a fresh session and the
one it left is ended; the LangChain adapter takes ``timeout``."""

from __future__ import annotations

import threading

import grpc
import pytest

pytest.importorskip("langchain_core")

from langchain_core.messages import AIMessage, HumanMessage, SystemMessage  # noqa: E402

from agent_adapters.client import ChainKVClient, ChainKVError, TextDelta  # noqa: E402


@pytest.fixture(scope="module")
def target(tiny_chat_server):
    return f"127.0.0.1:{tiny_chat_server.server.port}"


def test_a_turn_on_a_busy_session_waits_for_it_instead_of_failing(target):
    with ChainKVClient(target, timeout_s=300) as c:
        started, first = threading.Event(), {}

        def long_turn():
            for event in c.stream_turn("busy-1", [{"role": "user", "content": "go"}], max_tokens=1200, ignore_eos=True):
                if isinstance(event, TextDelta):
                    started.set()
                else:
                    first["result"] = event
            started.set()

        t = threading.Thread(target=long_turn)
        t.start()
        assert started.wait(120)
        second = c.turn("busy-1", [{"role": "user", "content": "and then?"}], max_tokens=4)
        t.join(300)
        assert first["result"].turn_index == 0 and second.turn_index == 1
        assert second.attempts >= 2  # it met the running turn and was retried, not failed
        assert c.get_session("busy-1").turn_index == 2


def test_an_edited_conversation_ends_the_session_it_leaves(target):
    from agent_adapters.langchain import ChatChainKV

    llm = ChatChainKV(target=target, max_tokens=4)
    cfg = {"configurable": {"thread_id": "edit-1"}}
    history = [SystemMessage("be brief"), HumanMessage("hi")]
    r1 = llm.invoke(history, config=cfg)
    r2 = llm.invoke(history + [r1, HumanMessage("more")], config=cfg)
    assert r1.response_metadata["session_id"] == r2.response_metadata["session_id"] == "edit-1"
    edited = [SystemMessage("be brief"), HumanMessage("hello"), AIMessage("x"), HumanMessage("more")]
    r3 = llm.invoke(edited, config=cfg)
    moved = r3.response_metadata["session_id"]
    assert moved.startswith("edit-1~") and r3.response_metadata["turn_index"] == 0
    with ChainKVClient(target) as c:
        assert c.get_session(moved).turn_index == 1
        with pytest.raises(ChainKVError) as e:
            c.get_session("edit-1")
        assert e.value.code is grpc.StatusCode.NOT_FOUND


def test_langchain_takes_timeout(target):
    from agent_adapters.langchain import ChatChainKV

    assert ChatChainKV(target=target, timeout=12).timeout_s == 12
    with pytest.raises(ChainKVError) as e:
        ChatChainKV(target=target, max_tokens=64).invoke("hi", timeout=1e-4)
    assert e.value.code is grpc.StatusCode.DEADLINE_EXCEEDED
    assert ChatChainKV(target=target, max_tokens=2, timeout=120).invoke("hi").usage_metadata["output_tokens"] > 0
