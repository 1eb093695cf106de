"""Agent hints over the wire (issue 27): gRPC's AgentHints / SessionControl and HTTP's ``nvext``, on a
live sidecar over the tiny chat model. A hostile hint (a priority, a pin TTL or an expected return out
of range) gets INVALID_ARGUMENT / 400, a pin past the tenant's pin quota or the pool's pin share
RESOURCE_EXHAUSTED / 429, and a turn reports where its time went (Usage.timing)."""

from __future__ import annotations

import json

import grpc
import httpx
import pytest

from sidecar._proto.chainkv.v1 import sidecar_pb2 as pb
from sidecar._proto.chainkv.v1 import sidecar_pb2_grpc
from tests.conftest import make_engine

TOKENS = {"tok-alpha": "alpha", "tok-beta": "beta"}
ALPHA = (("authorization", "Bearer tok-alpha"),)
BETA = (("authorization", "Bearer tok-beta"),)


@pytest.fixture(scope="module")
def live(tiny_chat_dir):
    from sidecar.grpc.auth import Authenticator
    from sidecar.http.app import HttpFront, HttpOptions
    from sidecar.turns.limits import TenantLimits
    from sidecar.grpc.server import ServerOptions, ServerThread

    engine = make_engine(
        tiny_chat_dir,
        num_pages=6000,
        prefill_chunk_size=128,
        max_model_len=4096,
        max_pin_ttl_s=120.0,
        max_pinned_fraction=0.05,
    )
    options = ServerOptions(
        port=0, auth=Authenticator(TOKENS), tenant_limits=TenantLimits(max_pinned_sessions_per_tenant=1)
    )
    thread = ServerThread(engine, options)
    port = thread.start()
    http = HttpFront(thread.server, HttpOptions(port=0))
    http_port = thread.run(http.start())
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    yield sidecar_pb2_grpc.SidecarStub(channel), f"http://127.0.0.1:{http_port}/v1", http.app.state.backend.model_name
    channel.close()
    thread.run(http.stop())
    thread.stop(grace=2)


def turn(stub, sid, metadata=ALPHA, **kw):
    kw.setdefault("max_tokens", 4)
    req = pb.TurnRequest(session_id=sid, messages=[pb.Message(role="user", content="hello there")], **kw)
    return list(stub.Turn(req, metadata=metadata))[-1].completion


def code_of(fn) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as e:
        fn()
    assert e.value.details() and "Traceback" not in e.value.details()
    return e.value.code()


def pin(ttl: float) -> pb.SessionControl:
    return pb.SessionControl(action="pin", ttl_seconds=ttl)


INVALID = grpc.StatusCode.INVALID_ARGUMENT


@pytest.mark.parametrize(
    "kw",
    [
        {"session_control": pin(float("nan"))},
        {"session_control": pin(float("inf"))},
        {"session_control": pin(-5.0)},
        {"session_control": pin(0.0)},
        {"session_control": pin(1e12)},  # past max_pin_ttl_s
        {"session_control": pb.SessionControl(action="pin")},  # no TTL
        {"session_control": pb.SessionControl(action="release", ttl_seconds=5.0)},
        {"session_control": pb.SessionControl(action="forever")},
        {"agent_hints": pb.AgentHints(priority=1000)},
        {"agent_hints": pb.AgentHints(priority=-(2**31))},
        {"agent_hints": pb.AgentHints(expected_return_s=float("nan"))},
        {"agent_hints": pb.AgentHints(expected_return_s=float("inf"))},
        {"agent_hints": pb.AgentHints(expected_return_s=-1.0)},
        {"agent_hints": pb.AgentHints(expected_return_s=0.0)},
        {"agent_hints": pb.AgentHints(expected_return_s=1e9)},  # past MAX_EXPECTED_RETURN_S
        {
            "agent_hints": pb.AgentHints(expected_return_s=5.0),
            "session_control": pb.SessionControl(action="release"),
        },
    ],
)
def test_hostile_hints_on_grpc_are_invalid_argument(live, kw):
    stub, _, _ = live
    sid = f"hostile-{abs(hash(str(kw))) % 10**8}"
    turn(stub, sid)  # the session exists; the bad turn leaves it as it was
    assert code_of(lambda: turn(stub, sid, **kw)) == INVALID
    assert stub.GetSession(pb.GetSessionRequest(session_id=sid), metadata=ALPHA).turn_index == 1


def test_an_expected_return_is_taken_on_both_fronts(live):
    stub, url, model = live
    assert turn(stub, "back-soon", agent_hints=pb.AgentHints(expected_return_s=4.0)).finish_reason
    assert turn(stub, "back-soon", agent_hints=pb.AgentHints(priority=2, expected_return_s=3600.0)).finish_reason
    body = {
        "model": model,
        "max_tokens": 4,
        "prompt_cache_key": "http-back-soon",
        "messages": [{"role": "user", "content": "run the tool"}],
        "nvext": {"agent_hints": {"priority": 1, "expected_return_s": 2.5}},
    }
    assert _post(url, body).status_code == 200


def test_a_tenant_pinning_past_its_quota_is_refused_until_it_releases(live):
    stub, _, _ = live
    first = turn(stub, "pin-a", session_control=pin(60.0), agent_hints=pb.AgentHints(priority=3))
    assert first.usage.timing.total_s > 0 and first.usage.timing.prefill_s > 0
    turn(stub, "pin-a", session_control=pin(60.0))  # renewing its own pin is not a second one
    assert code_of(lambda: turn(stub, "pin-b", session_control=pin(60.0))) == grpc.StatusCode.RESOURCE_EXHAUSTED
    turn(stub, "pin-b", metadata=BETA, session_control=pin(60.0))  # another tenant's quota
    turn(stub, "pin-a", session_control=pb.SessionControl(action="release"))
    s = stub.GetSession(pb.GetSessionRequest(session_id="pin-a"), metadata=ALPHA)
    assert s.state == pb.SESSION_STATE_HOST  # released: off the accelerator
    turn(stub, "pin-b", session_control=pin(60.0))
    turn(stub, "pin-b", session_control=pb.SessionControl(action="release"))
    turn(stub, "pin-b", metadata=BETA, session_control=pb.SessionControl(action="release"))


def test_a_pin_past_the_pools_pin_share_is_resource_exhausted(live):
    stub, _, _ = live
    with pytest.raises(grpc.RpcError) as e:
        turn(stub, "pin-huge", metadata=BETA, max_tokens=3000, session_control=pin(30.0))
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "may be pinned" in e.value.details()
    assert turn(stub, "pin-huge", metadata=BETA).finish_reason  # the session was left as it was


def _post(url: str, body: dict | bytes) -> httpx.Response:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(
        f"{url}/chat/completions",
        content=raw,
        timeout=60,
        headers={"Authorization": "Bearer tok-alpha", "Content-Type": "application/json"},
    )


@pytest.mark.parametrize(
    "nvext, status",
    [
        ('{"session_control": {"action": "pin", "ttl_seconds": NaN}}', 400),
        ('{"session_control": {"action": "pin", "ttl_seconds": Infinity}}', 400),
        ('{"session_control": {"action": "pin", "ttl_seconds": -1}}', 400),
        ('{"session_control": {"action": "pin", "ttl_seconds": "60"}}', 400),
        ('{"session_control": {"action": "pin", "ttl_seconds": 1e9}}', 400),
        ('{"session_control": {"action": "pin"}}', 400),
        ('{"session_control": {"action": 7}}', 400),
        ('{"session_control": "pin"}', 400),
        ('{"agent_hints": {"priority": 1000}}', 400),
        ('{"agent_hints": {"priority": 1.5}}', 400),
        ('{"agent_hints": {"osl": 100}}', 400),
        ('{"agent_hints": {"expected_return_s": NaN}}', 400),
        ('{"agent_hints": {"expected_return_s": -Infinity}}', 400),
        ('{"agent_hints": {"expected_return_s": 0}}', 400),
        ('{"agent_hints": {"expected_return_s": "5"}}', 400),
        ('{"agent_hints": {"expected_return_s": true}}', 400),
        ('{"agent_hints": {"expected_return_s": 1e9}}', 400),
        ('{"agent_hints": {"expected_return_s": 5}, "session_control": {"action": "release"}}', 400),
        ('{"hints": {}}', 400),
        ("[1]", 400),
    ],
)
def test_hostile_hints_on_http_get_openai_errors(live, nvext, status):
    _, url, model = live
    body = (
        f'{{"model": "{model}", "max_tokens": 4, "messages": [{{"role": "user", "content": "hi"}}], "nvext": {nvext}}}'
    )
    r = _post(url, body.encode())
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["message"] and "Traceback" not in err["message"]


def test_http_hints_pin_and_the_tenant_quota_is_429(live):
    _, url, model = live

    def chat(key: str, control: dict) -> httpx.Response:
        return _post(
            url,
            {
                "model": model,
                "max_tokens": 4,
                "prompt_cache_key": key,
                "messages": [{"role": "user", "content": f"task {key}"}],
                "nvext": {"agent_hints": {"priority": 2}, "session_control": control},
            },
        )

    assert chat("http-a", {"action": "pin", "ttl_seconds": 60}).status_code == 200
    r = chat("http-b", {"action": "pin", "ttl_seconds": 60})
    assert r.status_code == 429, r.text
    assert chat("http-b", {"action": "release"}).status_code == 200


def test_http_agent_hints_reach_the_turn_as_grpcs_do():
    from engine.chain import SessionHints
    from sidecar.http.requests import set_agent_hints
    from sidecar.turns.protocol import session_hints
    from sidecar.turns.request import TurnRequest, from_proto

    req = TurnRequest()
    set_agent_hints(req, {"nvext": {"agent_hints": {"priority": -2, "expected_return_s": 7}}})
    grpc_req = pb.TurnRequest(agent_hints=pb.AgentHints(priority=-2, expected_return_s=7.0))
    assert session_hints(req) == session_hints(from_proto(grpc_req)) == SessionHints(priority=-2, expected_return_s=7.0)
