"""Tenants on one sidecar, in process on SmolLM2 with a real redis-server.

``TestTenants`` (auth on, signed snapshots, tenant limits, metrics on a side port): tenant isolation on
every RPC, a tampered snapshot is DATA_LOSS, per-tenant limits with their status codes, Prometheus
metrics.

The class's server (``server``) lives for the class only: it serves the shared SmolLM2 engine and ends
every session on it when it stops, so the other files' servers never see its sessions.
"""

from __future__ import annotations

import time
import urllib.request

import grpc
import pytest

from security_fixtures import ALPHA, BETA, KEY, TOKENS, C, code_of, committed
from sidecar._proto.chainkv.v1 import sidecar_pb2 as pb
from sidecar._proto.chainkv.v1 import sidecar_pb2_grpc
from sidecar.store import RedisStore
from sidecar.store.integrity import SnapshotKeys


# --- tenants, limits, metrics ------------------------------------------------------------------------
@pytest.fixture(scope="class")
def server(smol_engine, redis_proc, tmp_path_factory):
    from sidecar.grpc.auth import Authenticator
    from sidecar.turns.limits import TenantLimits
    from sidecar.grpc.metrics import MetricsHooks
    from sidecar.grpc.server import ServerOptions, ServerThread

    store = RedisStore(redis_proc.url, prefix="sec", hmac_keys=SnapshotKeys([KEY]))
    hooks = MetricsHooks(smol_engine)
    metrics_port = hooks.serve(0, "127.0.0.1")
    options = ServerOptions(
        port=0,
        auth=Authenticator(TOKENS),
        snapshot_retry_max_s=0.5,
        resume_wait_s=1.0,
        tenant_limits=TenantLimits(
            max_sessions_per_tenant=3, max_tokens_per_turn=48, overrides={"beta": {"max_sessions_per_tenant": 2}}
        ),
    )
    srv = ServerThread(smol_engine, options, store, hooks)
    port = srv.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    yield srv, sidecar_pb2_grpc.SidecarStub(channel), store, metrics_port
    channel.close()
    srv.stop(grace=2)
    hooks.close()
    for sid in list(smol_engine.chains.chains):
        smol_engine.end_session(sid)


def turn(stub, sid, text, metadata=ALPHA, **kw):
    kw.setdefault("max_tokens", 6)
    req = pb.TurnRequest(session_id=sid, messages=[pb.Message(role="user", content=text)], **kw)
    return list(stub.Turn(req, metadata=metadata))[-1].completion


def wait_idle(stub, sid, metadata=ALPHA):
    for _ in range(400):
        if stub.GetSession(pb.GetSessionRequest(session_id=sid), metadata=metadata).state != pb.SESSION_STATE_ACTIVE:
            return
        time.sleep(0.05)
    raise AssertionError("the session stayed active")


class TestTenants:
    def test_tenants_cannot_touch_each_others_sessions(self, server):
        srv, stub, store, _ = server
        first = turn(stub, "shared-id", "Name a colour.")
        before = committed(stub, "shared-id")
        rid_req = pb.TurnRequest(
            session_id="shared-id",
            request_id="r-1",
            max_tokens=4,
            messages=[pb.Message(role="user", content="Another colour?")],
        )
        list(stub.Turn(rid_req, metadata=ALPHA))
        before = committed(stub, "shared-id")
        calls = {
            "GetSession": lambda: stub.GetSession(pb.GetSessionRequest(session_id="shared-id"), metadata=BETA),
            "Resume": lambda: stub.Resume(pb.ResumeRequest(session_id="shared-id"), metadata=BETA),
            "ForkSession": lambda: stub.ForkSession(
                pb.ForkSessionRequest(session_id="shared-id", new_session_id="stolen"), metadata=BETA
            ),
            "EndSession": lambda: stub.EndSession(pb.EndSessionRequest(session_id="shared-id"), metadata=BETA),
            "EndSession(keep)": lambda: stub.EndSession(
                pb.EndSessionRequest(session_id="shared-id", keep_snapshot=True), metadata=BETA
            ),
            "PruneHistory": lambda: stub.PruneHistory(
                pb.PruneHistoryRequest(session_id="shared-id", start=0, end=4), metadata=BETA
            ),
        }
        for name, call in calls.items():
            got = code_of(call) if name != "EndSession(keep)" else None
            if name == "EndSession(keep)":
                r = call()  # nothing of beta's to end: nothing happens to alpha's
                assert not r.ended_here and not r.deleted_from_store
            else:
                assert got == C.NOT_FOUND, name
        # beta replaying alpha's request id under the same session id gets its own new session, not the record
        mine = list(stub.Turn(rid_req, metadata=BETA))[-1].completion
        assert not mine.replayed and mine.turn_index == 0
        assert code_of(lambda: stub.Resume(pb.ResumeRequest(session_id="stolen"), metadata=BETA)) == C.NOT_FOUND
        after = stub.GetSession(pb.GetSessionRequest(session_id="shared-id"), metadata=ALPHA)
        assert (after.turn_index, after.generation, after.digest) == (
            before.turn_index,
            before.generation,
            before.digest,
        )
        # alpha's session is still there in the store, under alpha's key only
        assert store.load("alpha/shared-id", with_kv=False).turn_index == 2
        for sid, md in (("shared-id", ALPHA), ("shared-id", BETA)):
            stub.EndSession(pb.EndSessionRequest(session_id=sid), metadata=md)
        assert first.turn_index == 0

    def test_tampered_snapshot_is_refused_with_data_loss(self, server, smol_engine):
        srv, stub, store, _ = server
        turn(stub, "victim", "Say hello.")
        committed(stub, "victim")
        stub.EndSession(
            pb.EndSessionRequest(session_id="victim", keep_snapshot=True), metadata=ALPHA
        )  # only in Redis now
        r = store.client
        meta_key = store.meta_key("alpha/victim")
        good_tokens = r.hget(meta_key, "tokens")
        r.hset(meta_key, "tokens", good_tokens[:-4] + (1234).to_bytes(4, "little"))  # an injected history token
        sessions_before = len(smol_engine.chains.chains)
        for call in (
            lambda: stub.Resume(pb.ResumeRequest(session_id="victim"), metadata=ALPHA),
            lambda: stub.GetSession(pb.GetSessionRequest(session_id="victim"), metadata=ALPHA),
            lambda: turn(stub, "victim", "Go on."),
        ):
            assert code_of(call) == C.DATA_LOSS
        assert len(smol_engine.chains.chains) == sessions_before  # nothing reached the engine
        r.hset(meta_key, "tokens", good_tokens)  # restored: accepted again
        info = stub.Resume(pb.ResumeRequest(session_id="victim"), metadata=ALPHA)
        assert info.source_tier == pb.TIER_STORE and info.turn_index == 1
        stub.EndSession(pb.EndSessionRequest(session_id="victim"), metadata=ALPHA)

    def test_tenant_limits(self, server):
        srv, stub, _, _ = server
        turn(stub, "qs", "Hi.", max_tokens=2)  # a session only in the store: resuming it would hold one more
        committed(stub, "qs")
        stub.EndSession(pb.EndSessionRequest(session_id="qs", keep_snapshot=True), metadata=ALPHA)
        for i in range(3):
            turn(stub, f"q{i}", "Hi.", max_tokens=2)
        assert code_of(lambda: turn(stub, "q3", "Hi.", max_tokens=2)) == C.RESOURCE_EXHAUSTED
        assert (
            code_of(
                lambda: stub.ForkSession(pb.ForkSessionRequest(session_id="q0", new_session_id="q0b"), metadata=ALPHA)
            )
            == C.RESOURCE_EXHAUSTED
        )
        assert turn(stub, "q1", "Again.", max_tokens=2).turn_index == 1  # existing sessions carry on
        assert turn(stub, "b0", "Hi.", max_tokens=2, metadata=BETA).turn_index == 0  # another tenant's quota
        assert turn(stub, "b1", "Hi.", max_tokens=2, metadata=BETA).turn_index == 0
        assert (
            code_of(lambda: turn(stub, "b2", "Hi.", max_tokens=2, metadata=BETA)) == C.RESOURCE_EXHAUSTED
        )  # its own: 2
        assert code_of(lambda: stub.Resume(pb.ResumeRequest(session_id="qs"), metadata=ALPHA)) == C.RESOURCE_EXHAUSTED
        stub.EndSession(pb.EndSessionRequest(session_id="q2"), metadata=ALPHA)
        assert turn(stub, "q3", "Hi.", max_tokens=2).turn_index == 0
        # tokens per turn: an explicit max_tokens above it, a prompt above it; an unset one is clipped
        assert code_of(lambda: turn(stub, "q3", "Hi.", max_tokens=49)) == C.INVALID_ARGUMENT
        assert code_of(lambda: turn(stub, "q3", "word " * 80)) == C.INVALID_ARGUMENT
        wait_idle(stub, "q3")  # a turn refused after rendering releases the session on the engine thread
        req = pb.TurnRequest(session_id="q3", messages=[pb.Message(role="user", content="Count.")], ignore_eos=True)
        done = list(stub.Turn(req, metadata=ALPHA))[-1].completion
        assert done.usage.generated_tokens == 48
        for sid in ("q0", "q1", "q3", "qs"):
            stub.EndSession(pb.EndSessionRequest(session_id=sid), metadata=ALPHA)
        for sid in ("b0", "b1"):
            stub.EndSession(pb.EndSessionRequest(session_id=sid), metadata=BETA)
        from sidecar.turns.limits import TenantLimits, parse_overrides

        assert parse_overrides(
            ["batch:max_sessions_per_tenant=5,max_tokens_per_turn=9", "x:max_tokens_per_turn=2"]
        ) == {
            "batch": {"max_sessions_per_tenant": 5, "max_tokens_per_turn": 9},
            "x": {"max_tokens_per_turn": 2},
        }
        for bad in (["batch"], ["batch:max_sessions_per_tenant"], ["b:max_sessions_per_tenant=x"]):
            with pytest.raises(ValueError):
                parse_overrides(bad)
        with pytest.raises(ValueError, match="unknown tenant limit"):
            TenantLimits(overrides={"b": {"max_session": 1}})

    def test_metrics_on_the_side_port(self, server):
        srv, stub, _, metrics_port = server
        turn(stub, "m", "Name a planet.", max_tokens=5, ignore_eos=True)
        turn(stub, "m", "And another.", max_tokens=5, ignore_eos=True)
        committed(stub, "m")
        pruned = stub.PruneHistory(
            pb.PruneHistoryRequest(session_id="m", prune_roles=["user"], prune_lag=0), metadata=ALPHA
        )
        assert pruned.pruned_tokens > 0
        text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
        from prometheus_client.parser import text_string_to_metric_families

        samples = {}
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
        get = lambda name, **labels: samples.get((name, tuple(sorted(labels.items()))), 0)  # noqa: E731
        assert get("chainkv_ttft_seconds_count") >= 2
        assert get("chainkv_time_per_output_token_seconds_count") >= 2
        assert get("chainkv_turn_tokens_total", kind="generated") >= 10
        assert get("chainkv_kv_pages", state="used") > 0 and get("chainkv_kv_pages", state="free") > 0
        assert get("chainkv_sessions", tier="gpu") >= 1
        assert get("chainkv_snapshot_seconds_count") >= 1 and get("chainkv_snapshot_bytes_total") > 0
        assert ("chainkv_snapshot_failures_total", (("reason", "unavailable"),)) in samples
        assert get("chainkv_pruned_tokens_total", source="request") >= pruned.pruned_tokens
        assert get("chainkv_rpc_total", code="OK", rpc="Turn") >= 2
        assert get("chainkv_rpc_total", code="UNAUTHENTICATED", rpc="GetSession") == 0
        code_of(lambda: stub.GetSession(pb.GetSessionRequest(session_id="m")))
        text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
        assert 'chainkv_rpc_total{code="UNAUTHENTICATED",rpc="GetSession"} 1.0' in text
        stub.EndSession(pb.EndSessionRequest(session_id="m"), metadata=ALPHA)
