"""The adapters' bookkeeping without a server: the session ledger and stream resumption."""

from __future__ import annotations

import grpc
import pytest

from agent_adapters.ledger import SessionLedger, session_id_for
from agent_adapters.messages import ChatMessage, TextDelta, ToolCall, TurnResult, Usage
from agent_adapters.call_settings import CallSettings, RetryPolicy
from agent_adapters.retry import ChainKVError, StreamDiverged, _Attempts
from agent_adapters.turns import _Resume, build_turn_request
from sidecar._proto.chainkv.v1 import sidecar_pb2 as pb


def result(text: str, calls=()) -> TurnResult:
    return TurnResult("s", "r", 0, 1, "stop", text, tuple(calls), (), Usage(), False)


def test_ledger_sends_only_the_extension_and_moves_an_edited_history_to_a_fresh_session():
    ledger = SessionLedger()
    sys_, user = ChatMessage("system", "be brief"), ChatMessage("user", "hi")
    first = ledger.plan("thread-1", [sys_, user])
    assert first.session_id == "thread-1" and first.first and not first.known and first.messages == [sys_, user]
    ledger.record(first, result("hello", [ToolCall("call_0_0", "f", {"x": 1})]))
    reply = ChatMessage("assistant", "hello", tool_calls=(ToolCall("other-id", "f", {"x": 1}),))  # ids do not matter
    tool = ChatMessage("tool", "42", tool_call_id="call_0_0")
    second = ledger.plan("thread-1", [sys_, user, reply, tool])
    assert second.session_id == "thread-1" and not second.first and second.messages == [tool]
    edited = ledger.plan("thread-1", [sys_, ChatMessage("user", "HI"), reply, tool])
    assert edited.session_id.startswith("thread-1~") and edited.first and len(edited.messages) == 4
    same = ledger.plan("thread-1", [sys_, user])  # nothing new: cannot be a continuation either
    assert same.first and same.session_id != "thread-1"
    with pytest.raises(ValueError):
        ledger.plan("thread-1", [])


def test_keys_that_are_not_session_ids_are_hashed():
    assert session_id_for("run-42") == "run-42"
    weird = session_id_for("user/42 {x}")
    assert weird.startswith("h-") and weird == session_id_for("user/42 {x}") and len(weird) <= 128


def _delta(text: str, ids) -> pb.TurnEvent:
    return pb.TurnEvent(delta=pb.TextDelta(text=text, token_ids=ids))


def test_a_retried_stream_delivers_only_what_was_not_delivered():
    r = _Resume()
    r.new_attempt()
    out = r.feed(_delta("Hel", [1])) + r.feed(_delta("lo", [2]))
    assert out == [TextDelta("Hel", (1,)), TextDelta("lo", (2,))]
    r.new_attempt()  # the replay: the whole text at once, then the completion
    out = r.feed(_delta("Hello world", [1, 2, 3]))
    assert out == [TextDelta(" world", (3,))]
    done = r.feed(pb.TurnEvent(completion=pb.TurnCompletion(text="Hello world", token_ids=[1, 2, 3], replayed=True)))
    assert isinstance(done[0], TurnResult) and done[0].replayed and done[0].attempts == 2


def test_a_retried_stream_that_differs_raises():
    r = _Resume()
    r.new_attempt()
    r.feed(_delta("Hello", [1]))
    r.new_attempt()
    with pytest.raises(StreamDiverged) as e:
        r.feed(_delta("Goodbye", [9]))
    assert e.value.code is grpc.StatusCode.DATA_LOSS


def test_turn_requests_take_engine_names_and_reject_unknown_options():
    req = build_turn_request(
        "s",
        [{"role": "user", "content": "x"}],
        max_tokens=4,
        stop="END",
        method="dense",
        method_args={"n_sink": 4},
        tools=[{"type": "function", "function": {"name": "f"}}],
    )
    assert req.max_tokens == 4 and list(req.stop) == ["END"] and req.method_args["n_sink"] == "4"
    assert req.request_id and req.tools[0].name == "f" and not req.HasField("temperature")
    assert build_turn_request("s", [{"role": "user", "content": "x"}], request_id="").request_id == ""
    with pytest.raises(TypeError):
        build_turn_request("s", [{"role": "user", "content": "x"}], max_token=4)


class _Failed(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode):
        self._code = code

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return "failed"


def _settings(timeout_s=None, max_attempts: int = 3) -> CallSettings:
    """The settings of a client's calls, which _Attempts reads."""
    return CallSettings(
        metadata=(("authorization", "Bearer t"),),
        timeout_s=timeout_s,
        retry=RetryPolicy(max_attempts=max_attempts, initial_backoff_s=0.1, max_backoff_s=0.3),
    )


def test_attempts_retry_unavailable_then_aborted_up_to_max_attempts():
    a = _Attempts(_settings(), None, repeatable=True)
    first = a.next()
    assert first["wait_for_ready"] is False and first["timeout"] is None and first["metadata"] == _settings().metadata
    with pytest.raises(ChainKVError) as e:
        a.backoff_after(_Failed(grpc.StatusCode.ABORTED))  # ABORTED on the first attempt is final
    assert e.value.code is grpc.StatusCode.ABORTED and e.value.attempts == 1
    a = _Attempts(_settings(), None, repeatable=True)
    a.next()
    assert 0.05 <= a.backoff_after(_Failed(grpc.StatusCode.UNAVAILABLE)) <= 0.1  # jittered initial backoff
    assert a.next()["wait_for_ready"] is True
    assert 0.1 <= a.backoff_after(_Failed(grpc.StatusCode.ABORTED)) <= 0.2  # a retry may meet the rollback
    a.next()
    with pytest.raises(ChainKVError) as e:  # the third attempt was the last
        a.backoff_after(_Failed(grpc.StatusCode.UNAVAILABLE))
    assert e.value.attempts == 3


def test_attempts_not_repeatable_other_codes_and_the_deadline_are_final():
    for client, repeatable, code in [
        (_settings(), False, grpc.StatusCode.UNAVAILABLE),
        (_settings(), True, grpc.StatusCode.INVALID_ARGUMENT),
        (_settings(timeout_s=0.0), True, grpc.StatusCode.UNAVAILABLE),
    ]:
        a = _Attempts(client, None, repeatable=repeatable)
        opts = a.next()
        with pytest.raises(ChainKVError) as e:
            a.backoff_after(_Failed(code))
        assert e.value.code is code and e.value.attempts == 1
    assert opts["timeout"] == 0.0  # the call's deadline had passed: no time left for the attempt
    a = _Attempts(_settings(timeout_s=0.0), 60.0, repeatable=True)  # the call's timeout_s overrides the client's
    assert 0 < a.next()["timeout"] <= 60.0


class _Busy(_Failed):
    def __init__(self):
        super().__init__(grpc.StatusCode.ABORTED)

    def details(self) -> str:
        return "a turn is already running on session 's'"


def test_a_busy_session_is_retried_for_every_call_until_the_deadline():
    a = _Attempts(_settings(timeout_s=60.0, max_attempts=2), None, repeatable=False)  # even a fork / a prune
    for _ in range(5):  # past max_attempts: the deadline bounds busy retries
        a.next()
        assert 0.0 < a.backoff_after(_Busy()) <= 0.3
    a = _Attempts(_settings(max_attempts=2), None, repeatable=True)  # no deadline: max_attempts bounds them
    a.next()
    assert a.backoff_after(_Busy()) > 0
    a.next()
    with pytest.raises(ChainKVError) as e:
        a.backoff_after(_Busy())
    assert e.value.code is grpc.StatusCode.ABORTED and e.value.attempts == 2
    a = _Attempts(_settings(timeout_s=0.0), None, repeatable=True)  # no time left: final
    a.next()
    with pytest.raises(ChainKVError):
        a.backoff_after(_Busy())


def test_chatchainkv_takes_its_bearer_token_as_api_key_too_and_keeps_it_out_of_its_repr():
    pytest.importorskip("langchain_core")
    from agent_adapters.langchain import ChatChainKV

    for llm in (ChatChainKV(api_key="s3cret"), ChatChainKV(token="s3cret")):
        assert llm.conversations.token == "s3cret"  # what the client sends as the bearer token
        assert "s3cret" not in repr(llm)
    assert ChatChainKV().conversations.token is None


def test_chainkvllm_takes_its_bearer_token_as_api_key_too_and_keeps_it_out_of_its_repr_and_json():
    pytest.importorskip("llama_index.core")
    from agent_adapters.llamaindex import ChainKVLLM

    for llm in (ChainKVLLM(api_key="s3cret"), ChainKVLLM(token="s3cret")):
        assert llm.conversations.token == "s3cret"
        assert "s3cret" not in repr(llm) and "s3cret" not in llm.to_json()
    assert ChainKVLLM().conversations.token is None


def test_both_clients_open_a_tls_channel_with_the_ca_and_a_plain_one_without(tmp_path, monkeypatch):
    from unittest import mock

    from agent_adapters.client import AsyncChainKVClient, ChainKVClient

    ca = tmp_path / "ca.pem"
    ca.write_bytes(b"CA BYTES")
    seen = []
    monkeypatch.setattr(grpc, "ssl_channel_credentials", lambda root: ("creds", root))
    for channels in (grpc, grpc.aio):
        monkeypatch.setattr(
            channels,
            "secure_channel",
            lambda target, creds, options, m=channels: seen.append((m, target, creds)) or mock.Mock(),
        )
    sync_client = ChainKVClient("h:1", tls_ca=str(ca), token="t")
    async_client = AsyncChainKVClient("h:2", tls_ca=str(ca))
    assert seen == [(grpc, "h:1", ("creds", b"CA BYTES")), (grpc.aio, "h:2", ("creds", b"CA BYTES"))]
    assert sync_client.settings.metadata == (("authorization", "Bearer t"),) and async_client.settings.metadata == ()
    plain = ChainKVClient("h:3", max_message_bytes=123)
    assert isinstance(plain.channel, grpc.Channel) and plain.stub is not None
    plain.close()


def test_both_clients_send_the_session_id_as_metadata_on_every_session_call():
    """A pool's proxy routes on ``x-session-id`` (deploy/k8s/overlays/pool/haproxy.cfg)."""
    import asyncio
    from unittest import mock

    from agent_adapters.client import AsyncChainKVClient, ChainKVClient
    from agent_adapters.turns import build_turn_request

    expected = (("authorization", "Bearer t"), ("x-session-id", "run-7"))
    client = ChainKVClient("h:1", token="t")
    assert (
        client._turn_attempts(build_turn_request("run-7", [{"role": "user", "content": "hi"}]), None).next()["metadata"]
        == expected
    )
    client.stub = mock.Mock()
    client.get_session("run-7")
    client.end_session("run-7")
    client.resume("run-7")
    client.fork_session("run-7", "run-8")
    for call in client.stub.method_calls:
        assert call.kwargs["metadata"] == expected, call
    client.server_info()  # names no session: no header
    assert client.stub.method_calls[-1].kwargs["metadata"] == (("authorization", "Bearer t"),)
    client.close()

    async def run_async():
        aclient = AsyncChainKVClient("h:2")
        aclient.stub = mock.Mock(GetSession=mock.AsyncMock(), EndSession=mock.AsyncMock())
        await aclient.get_session("run-7")
        await aclient.end_session("run-7")
        await aclient.close()
        return [c.kwargs["metadata"] for c in (aclient.stub.GetSession.await_args, aclient.stub.EndSession.await_args)]

    assert asyncio.run(run_async()) == [(("x-session-id", "run-7"),)] * 2
