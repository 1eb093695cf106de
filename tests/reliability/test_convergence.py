"""The durability contract converges (issue 30): the transcript the agent framework holds is the
truth, the store a cache of it.

One ``chainkv serve`` process (``--durability async``, snapshot signing on, gRPC and HTTP fronts)
runs a reference conversation without interruption, and the same conversation through each front
the framework uses: the plain client, LangChain's ChatChainKV, LlamaIndex's ChainKVLLM and the
OpenAI chat route (``prompt_cache_key``). After the first turn has committed everywhere, the whole
Redis is copied (every key, the fences included); the second turn is acknowledged on every front
and the process is SIGKILLed at once; the copy is put back over the store (a whole-store
rollback: an older, validly signed record with its fence, which store-side state cannot tell
apart from the truth). A fresh process then serves the third and fourth turns. Each front must
notice that the session lost a turn, re-send what it lacks, and give the reference's replies
token for token (greedy); the sidecar must refuse the turn that expects the lost index
(FAILED_PRECONDITION with the session's real turn count) rather than run it on the older state.
"""

from __future__ import annotations

import asyncio
import signal
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import grpc
import openai
import pytest
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage
from llama_index.core.base.llms.types import ChatMessage as LIMessage, MessageRole

from agent_adapters.client import ChainKVClient, ChainKVError
from agent_adapters.langchain import ChatChainKV
from agent_adapters.llamaindex import ChainKVLLM
from sidecar._proto.chainkv.v1 import sidecar_pb2 as pb

from tests.sidecar_proc import ALPHA, TOKENS, Sidecar, committed, wait_for
from tests.tcp_proxy import TcpProxy

pytestmark = [pytest.mark.slow, pytest.mark.reliability]

TOKEN = "tok-alpha"
SYSTEM = "You are a concise assistant."
USERS = ["Name three fruits.", "Which of them is yellow?", "Name one more fruit.", "What colour is it?"]
SAMPLING = dict(max_tokens=16, temperature=0.0)


@dataclass
class Reply:
    text: str
    token_ids: list[int] | None  # None: the front does not expose them (the OpenAI route)
    completion_tokens: int


class Plain:
    """The plain client, as a caller that keeps its transcript and passes ``expected_turn_index``."""

    session = "conv-plain"

    def __init__(self, target: str):
        self.client = ChainKVClient(target, token=TOKEN)
        self.messages: list[dict] = [{"role": "system", "content": SYSTEM}]
        self.sent = 0  # messages the session holds
        self.starts: list[int] = []  # messages the session held before each of its turns

    def turn(self, user: str, expected: int | None = None) -> Reply:
        self.messages.append({"role": "user", "content": user})
        index = len(self.starts) if expected is None else expected
        r = self.client.turn(self.session, self.messages[self.sent :], expected_turn_index=index, **SAMPLING)
        self.starts = self.starts[:index] + [self.sent]
        self.messages.append({"role": "assistant", "content": r.text})
        self.sent = len(self.messages)
        return Reply(r.text, list(r.token_ids), len(r.token_ids))


class LangChain:
    session = "conv-lc"

    def __init__(self, target: str):
        self.llm = ChatChainKV(target=target, token=TOKEN, **SAMPLING)
        self.messages: list = [SystemMessage(SYSTEM)]

    def turn(self, user: str) -> Reply:
        self.messages.append(HumanMessage(user))
        out = self.llm.invoke(self.messages, config={"configurable": {"thread_id": self.session}})
        self.messages.append(AIMessage(out.content))
        self.turn_index = out.response_metadata["turn_index"]
        ids = out.response_metadata["token_ids"]
        return Reply(out.content, ids, len(ids))


class LlamaIndex:
    session = "conv-li"

    def __init__(self, target: str):
        self.llm = ChainKVLLM(target=target, token=TOKEN, session_id=self.session, **SAMPLING)
        self.messages = [LIMessage(role=MessageRole.SYSTEM, content=SYSTEM)]

    def turn(self, user: str) -> Reply:
        self.messages.append(LIMessage(role=MessageRole.USER, content=user))
        out = asyncio.run(self.llm.achat(self.messages))  # the asyncio path of the adapter
        self.messages.append(out.message)
        ids = out.raw["token_ids"]
        return Reply(out.message.content, ids, len(ids))


class OpenAIRoute:
    session = "pck-conv-oa"  # the sidecar session of prompt_cache_key "conv-oa"

    def __init__(self, http_port: int):
        self.client = openai.OpenAI(base_url=f"http://127.0.0.1:{http_port}/v1", api_key=TOKEN, max_retries=0)
        self.messages: list[dict] = [{"role": "system", "content": SYSTEM}]

    def turn(self, user: str) -> Reply:
        self.messages.append({"role": "user", "content": user})
        r = self.client.chat.completions.create(
            model=self.client.models.list().data[0].id,
            messages=self.messages,
            prompt_cache_key="conv-oa",
            **SAMPLING,
        )
        text = r.choices[0].message.content or ""
        self.messages.append({"role": "assistant", "content": text})
        return Reply(text, None, r.usage.completion_tokens)


@dataclass
class RolledBack:
    proc: Sidecar
    restart: Callable[[], Sidecar]
    """SIGKILL ``proc`` and start a fresh one behind the same gRPC address; returns it."""
    target: str
    """That address (the clients' gRPC target)."""
    reference: list[Reply]
    fronts: dict[str, object]
    before: dict[str, list[Reply]] = field(default_factory=dict)


def _stored_turn(redis_client, session: str) -> int:
    return int(redis_client.hget(f"chainkv:{{alpha/{session}}}:meta", "turn_index"))


@pytest.fixture(scope="module")
def rolled_back(redis_proc, tmp_path_factory):
    keyfile = Path(tmp_path_factory.mktemp("hmac")) / "key"
    keyfile.write_text("k" * 64 + "\n")
    flags = ("--durability", "async", "--http-port", "0", "--snapshot-hmac-key-file", str(keyfile))
    procs = [Sidecar(redis_proc.url, *flags).start().wait_ready()]
    r = redis_proc.client()
    proxy = TcpProxy(procs[0].port)  # the address the gRPC clients know (a load balancer's)

    def restart() -> Sidecar:
        assert procs[-1].kill() == -signal.SIGKILL
        procs.append(Sidecar(redis_proc.url, *flags).start().wait_ready())
        proxy.upstream = ("127.0.0.1", procs[-1].port)
        return procs[-1]

    proc = procs[0]
    try:
        target = proxy.target
        reference = Plain(target)
        reference.session = "conv-reference"
        ref = [reference.turn(u) for u in USERS]
        fronts = {
            "plain": Plain(target),
            "langchain": LangChain(target),
            "llamaindex": LlamaIndex(target),
            "openai": OpenAIRoute(proc.http_port),
        }
        before = {name: [f.turn(USERS[0])] for name, f in fronts.items()}
        for f in fronts.values():
            wait_for(lambda: committed(proc.stub, f.session), what=f"{f.session}'s first snapshot")
        copy = {k: r.dump(k) for k in r.keys("*")}  # the whole store after turn 0, fences included
        for name, f in fronts.items():
            before[name].append(f.turn(USERS[1]))
        assert procs[-1].kill() == -signal.SIGKILL  # at 0 ms after the last acknowledged completion
        r.flushall()
        for k, v in copy.items():
            r.restore(k, 0, v)
        stored = {name: _stored_turn(r, f.session) for name, f in fronts.items()}
        assert set(stored.values()) == {1}  # the acknowledged turn 1 is gone from every session
        procs.append(Sidecar(redis_proc.url, *flags).start().wait_ready())
        proxy.upstream = ("127.0.0.1", procs[-1].port)  # the gRPC clients reach it at the same address
        fronts["openai"].client = OpenAIRoute(procs[-1].http_port).client
        yield RolledBack(procs[-1], restart, proxy.target, ref, fronts, before)
    finally:
        procs[-1].stop()
        proxy.close()


def _same(got: list[Reply], ref: list[Reply]) -> None:
    for i, (g, want) in enumerate(zip(got, ref, strict=True)):
        assert g.text == want.text, f"turn {i}: {g.text!r} != {want.text!r}"
        assert g.completion_tokens == want.completion_tokens, f"turn {i}"
        if g.token_ids is not None:
            assert g.token_ids == want.token_ids, f"turn {i}"


def test_the_sidecar_refuses_a_turn_that_expects_a_lost_index_and_says_where_the_session_is(rolled_back):
    """The plain client: FAILED_PRECONDITION with the session's real turn count (1), nothing run on
    the older state; re-sending the messages after turn 1 continues with the reference's tokens."""
    f = rolled_back.fronts["plain"]
    stub = rolled_back.proc.stub
    with pytest.raises(ChainKVError) as e:
        f.client.turn(f.session, [{"role": "user", "content": USERS[2]}], expected_turn_index=2, **SAMPLING)
    assert e.value.code is grpc.StatusCode.FAILED_PRECONDITION and e.value.session_turn_index == 1
    info = stub.GetSession(pb.GetSessionRequest(session_id=f.session), metadata=ALPHA)
    assert info.turn_index == 1  # the refused turn ran nowhere
    f.sent = f.starts[1]  # the session holds the messages before turn 1: re-send the rest with turn 2
    got = rolled_back.before["plain"] + [f.turn(USERS[2], expected=1), f.turn(USERS[3])]
    _same(got, rolled_back.reference)


@pytest.mark.parametrize("front", ["langchain", "llamaindex", "openai"])
def test_a_framework_front_continues_a_rolled_back_session_with_the_reference_tokens(
    rolled_back, front, reliability_report
):
    """The framework's next call after the crash and the rollback simply succeeds (the adapter or the
    route re-sends the lost turn's messages), and so does the one after it."""
    f = rolled_back.fronts[front]
    got = rolled_back.before[front] + [f.turn(USERS[2]), f.turn(USERS[3])]
    _same(got, rolled_back.reference)
    reliability_report["faults"].append(
        {
            "fault": f"SIGKILL at 0 ms after a completion + whole-store rollback (signed records, fences); {front}",
            "count": 1,
            "sessions": 1,
            "sessions_lost": 0,
            "acknowledged_turns_refilled": 1,
            "resumed_identical": True,
        }
    )


def test_a_kill_right_after_an_acknowledged_turn_converges_whatever_the_store_kept(
    rolled_back, redis_proc, reliability_report
):
    """No rollback: SIGKILL 0 ms after a completion under async. The store holds the turn or not (a
    race with the write-behind snapshot); LangChain's next call continues with the reference's tokens
    either way. Runs last: it replaces the module's process."""
    lc = LangChain(rolled_back.target)
    lc.session = "conv-lc-kill"
    got = [lc.turn(USERS[0])]
    wait_for(lambda: committed(rolled_back.proc.stub, lc.session), what="the first snapshot")
    got.append(lc.turn(USERS[1]))
    rolled_back.proc = rolled_back.restart()
    kept = _stored_turn(redis_proc.client(), lc.session)
    assert kept in (1, 2)
    got += [lc.turn(USERS[2]), lc.turn(USERS[3])]
    _same(got, rolled_back.reference)
    assert lc.turn_index == (3 if kept == 2 else 2)  # a lost turn 1 was refilled within turn 2's call
    reliability_report["faults"].append(
        {
            "fault": "SIGKILL sidecar at 0 ms after a completion (--durability async), LangChain continues",
            "count": 1,
            "sessions": 1,
            "sessions_lost": 0,
            "store_turn_after_kill": kept,
            "acknowledged_turns_refilled": 2 - kept,
            "resumed_identical": True,
        }
    )


def test_a_replica_without_a_store_that_lost_a_session_is_sent_the_whole_conversation_again(smol_engine):
    """``--store none``: a session the replica no longer holds (a restart, here EndSession) exists
    nowhere; the sidecar says it is at turn 0 and LangChain's next call sends the whole conversation
    as a first turn, which continues with the reference's tokens."""
    from sidecar.grpc.auth import Authenticator
    from sidecar.grpc.server import ServerOptions, ServerThread

    srv = ServerThread(smol_engine, ServerOptions(port=0, auth=Authenticator(TOKENS)), None)
    target = f"127.0.0.1:{srv.start()}"
    try:
        reference = Plain(target)
        reference.session = "mem-reference"
        ref = [reference.turn(u) for u in USERS[:3]]
        lc = LangChain(target)
        lc.session = "mem-lc"
        got = [lc.turn(USERS[0]), lc.turn(USERS[1])]
        ChainKVClient(target, token=TOKEN).end_session(lc.session)
        got.append(lc.turn(USERS[2]))
        assert lc.turn_index == 0  # the catch-up turn is the session's first
        _same(got, ref)
    finally:
        srv.stop(grace=2)
        for sid in list(smol_engine.chains.chains):
            smol_engine.end_session(sid)
