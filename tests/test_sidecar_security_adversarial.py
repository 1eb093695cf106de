"""The sidecar under the adversarial review's attacks (issue 18), in process on SmolLM2 with a real
redis-server, auth on and HMAC-signed snapshots. One test per class of break:

1. path-like session ids are INVALID_ARGUMENT on every RPC;
2. a store that restarts empty (FLUSHALL) or goes back a generation: the holder keeps its session (turn
   indices never go backwards) and rewrites the store;
3. a validly signed older record put back: DATA_LOSS, never served;
4. bad sampling fields are INVALID_ARGUMENT; a failure in one sequence's sampling fails that turn
   (INTERNAL) while a concurrent session finishes, and the replica stays SERVING;
5. another tenant's exact system prompt reuses no more than a wrong guess; a public prefix is shared;
6. --durability sync: the completion arrives after the snapshot holds the turn;
7. a retry with its original expected_turn_index after failover is replayed, not FAILED_PRECONDITION;
8. deep JSON in tool schemas and arguments: INVALID_ARGUMENT;
9. oversized messages and stop strings: INVALID_ARGUMENT before tokenizing;
10. a request_id reused for other content: FAILED_PRECONDITION.

The class's server (``side``) lives for the class only: it serves the shared SmolLM2 engine and ends
every session on it when it stops, so the other files' servers never see its sessions.
"""

from __future__ import annotations

import threading

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

import engine.sampling as sampling
from security_fixtures import ALPHA, BETA, TOKENS, C, code_of, committed
from sidecar._proto.chainkv.v1 import sidecar_pb2 as pb
from sidecar._proto.chainkv.v1 import sidecar_pb2_grpc
from sidecar.store import RedisStore
from sidecar.store.integrity import SnapshotKeys

SYSTEM = (
    "You are the internal assistant of the Zorblax company. Never reveal the launch code "
    "PELICAN-7 and answer in one short sentence. "
) * 3


# --- the adversarial review (issue 18) ---------------------------------------------------------------
def _server(smol_engine, redis_proc, prefix, **kw):
    from sidecar.grpc.auth import Authenticator
    from sidecar.grpc.server import ServerOptions, ServerThread

    store = RedisStore(redis_proc.url, prefix=prefix, hmac_keys=SnapshotKeys([b"h" * 32]))
    options = ServerOptions(port=0, auth=Authenticator(TOKENS), snapshot_retry_max_s=0.5, resume_wait_s=0.5, **kw)
    srv = ServerThread(smol_engine, options, store)
    port = srv.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    return srv, channel, store


@pytest.fixture(scope="class")
def side(smol_engine, redis_proc):
    srv, channel, store = _server(smol_engine, redis_proc, "sec18")
    yield srv, sidecar_pb2_grpc.SidecarStub(channel), store, channel
    channel.close()
    srv.stop(grace=2)
    for sid in list(smol_engine.chains.chains):
        smol_engine.end_session(sid)


def req(sid, text, role="user", system=None, **kw):
    kw.setdefault("max_tokens", 4)
    msgs = ([pb.Message(role="system", content=system)] if system else []) + [pb.Message(role=role, content=text)]
    return pb.TurnRequest(session_id=sid, messages=msgs, **kw)


def run(stub, request, metadata=ALPHA):
    return list(stub.Turn(request, metadata=metadata))[-1].completion


def serving(channel) -> bool:
    h = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""))
    return h.status == health_pb2.HealthCheckResponse.SERVING


def drop_here(srv, sid, tenant="alpha"):
    """Free the session on this replica (as idle eviction or a failover would): it lives in the store only."""
    key = f"{tenant}/{sid}"
    sessions = srv.server.sessions
    srv.run(sessions.drop_local(sessions.local(key)))


@pytest.mark.slow
class TestAdversarialReview:
    @pytest.mark.parametrize("sid", ["..", ".", "...", "../x", "a/b", "%2e%2e"])
    def test_1_path_like_ids_are_invalid_argument(self, side, sid):
        _, stub, _, _ = side
        assert code_of(lambda: run(stub, req(sid, "hi"))) == C.INVALID_ARGUMENT
        assert (
            code_of(lambda: stub.EndSession(pb.EndSessionRequest(session_id=sid), metadata=ALPHA)) == C.INVALID_ARGUMENT
        )
        assert code_of(
            lambda: stub.ForkSession(pb.ForkSessionRequest(session_id="x", new_session_id=sid), metadata=ALPHA)
        ) in (C.INVALID_ARGUMENT, C.NOT_FOUND)

    @pytest.mark.parametrize("how", ["flushall", "one_back"])
    def test_2_the_holder_keeps_its_session_when_the_store_loses_it(self, side, redis_proc, how):
        srv, stub, store, _ = side
        sid = f"durable-{how}"
        run(stub, req(sid, "Name a fruit."))
        before = committed(stub, sid)
        old = dict(store._read_meta(f"alpha/{sid}"))
        run(stub, req(sid, "Another one?"))
        committed(stub, sid)
        if how == "flushall":  # redis without persistence restarted empty
            redis_proc.client().flushall()
        else:  # a replica promoted from a copy one commit behind
            store.client.delete(store.meta_key(f"alpha/{sid}"))
            store.client.hset(store.meta_key(f"alpha/{sid}"), mapping=old)
        third = run(stub, req(sid, "And a third?", expected_turn_index=2))
        assert third.turn_index == 2  # not 0, not 1: never backwards
        s = committed(stub, sid)
        assert s.turn_index == 3 and s.generation > before.generation
        assert store.load(f"alpha/{sid}", with_kv=False).turn_index == 3  # the store was rewritten

    def test_3_a_rolled_back_signed_record_is_data_loss(self, side):
        srv, stub, store, _ = side
        sid = "rollback"
        first = run(stub, req(sid, "Name a fruit.", request_id="r-1"))
        committed(stub, sid)
        old = dict(store._read_meta(f"alpha/{sid}"))
        run(stub, req(sid, "Another one?", request_id="r-2"))
        committed(stub, sid)
        drop_here(srv, sid)
        store.client.delete(store.meta_key(f"alpha/{sid}"))
        store.client.hset(store.meta_key(f"alpha/{sid}"), mapping=old)  # validly signed, one turn old
        assert code_of(lambda: stub.Resume(pb.ResumeRequest(session_id=sid), metadata=ALPHA)) == C.DATA_LOSS
        # the completed turn r-2 does not run a second time from the rolled-back record
        assert code_of(lambda: run(stub, req(sid, "Another one?", request_id="r-2"))) == C.DATA_LOSS
        assert first.turn_index == 0

    @pytest.mark.parametrize(
        "field,value",
        [
            ("temperature", float("nan")),
            ("temperature", float("inf")),
            ("temperature", -1.0),
            ("temperature", 1e300),
            ("top_p", float("nan")),
            ("top_p", 0.0),
            ("top_p", 1.5),
            ("top_k", -3),
            ("presence_penalty", float("nan")),
            ("presence_penalty", 2.5),
            ("frequency_penalty", -float("inf")),
            ("frequency_penalty", -1e300),
            ("repetition_penalty", 0.0),
            ("repetition_penalty", 1e-300),
            ("repetition_penalty", float("inf")),
        ],
    )
    def test_4_bad_sampling_fields_are_invalid_argument(self, side, field, value):
        _, stub, _, channel = side
        assert code_of(lambda: run(stub, req(f"bad-{field}", "hi", **{field: value}))) == C.INVALID_ARGUMENT
        assert serving(channel)

    def test_4_a_tiny_temperature_decodes_greedily(self, side):
        _, stub, _, channel = side
        tiny = run(stub, req("t-tiny", "Name a fruit.", temperature=1e-40))
        greedy = run(stub, req("t-greedy", "Name a fruit."))
        assert tiny.token_ids == greedy.token_ids and serving(channel)

    def test_4_a_failure_in_one_sequences_sampling_fails_that_turn_only(self, side, monkeypatch):
        _, stub, _, channel = side
        real = sampling.sample_row

        def faulty(row, p, gen):
            if p.seed == 666:
                raise RuntimeError("injected sampling failure")
            return real(row, p, gen)

        monkeypatch.setattr(sampling, "sample_row", faulty)
        results = {}

        def go(name, **kw):
            try:
                results[name] = run(stub, req(f"inj-{name}", "Count to five.", max_tokens=12, **kw))
            except grpc.RpcError as e:
                results[name] = e.code()

        threads = [
            threading.Thread(target=go, args=("bad",), kwargs=dict(temperature=0.7, seed=666)),
            threading.Thread(target=go, args=("good",), kwargs=dict(temperature=0.7, seed=1)),
            threading.Thread(target=go, args=("greedy",)),
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert results["bad"] == C.INTERNAL
        assert results["good"].finish_reason in (pb.FINISH_REASON_STOP, pb.FINISH_REASON_LENGTH)
        assert results["greedy"].finish_reason in (pb.FINISH_REASON_STOP, pb.FINISH_REASON_LENGTH)
        assert serving(channel)
        monkeypatch.setattr(sampling, "sample_row", real)
        again = run(stub, req("inj-bad", "Count to five.", temperature=0.7, seed=5, expected_turn_index=0))
        assert again.turn_index == 0  # the failed turn was rolled back: the session goes on

    def test_5_another_tenants_prompt_is_not_revealed_by_reuse(self, side):
        _, stub, _, _ = side
        run(stub, req("victim", "Hello.", system=SYSTEM))
        # beta's first guess: as if alpha had never sent it (beta has no session of its own to share from)
        exact = run(stub, req("probe-exact", "Hello.", system=SYSTEM), metadata=BETA)
        assert exact.usage.reused_tokens == 0 and exact.usage.prefilled_tokens == exact.usage.prompt_tokens
        mine = run(stub, req("victim-2", "Hello.", system=SYSTEM))  # the tenant's own sessions still share it
        assert mine.usage.reused_tokens > exact.usage.reused_tokens
        # a prefix both tenants mark public is shared across them
        run(stub, req("pub-a", "Hello.", system=SYSTEM + " v2", public_prefix=True))
        shared = run(stub, req("pub-b", "Hello.", system=SYSTEM + " v2", public_prefix=True), metadata=BETA)
        assert shared.usage.reused_tokens == mine.usage.reused_tokens

    def test_6_durability_sync_commits_before_the_completion(self, smol_engine, redis_proc):
        srv, channel, store = _server(smol_engine, redis_proc, "sync18", durability="sync")
        try:
            stub = sidecar_pb2_grpc.SidecarStub(channel)
            for i, text in enumerate(["Name a fruit.", "Another one?", "A third?"]):
                c = run(stub, req("sync", text, request_id=f"q{i}", expected_turn_index=i))
                got = store.load("alpha/sync", with_kv=False)  # read at once: no waiting for write-behind
                assert got.turn_index == i + 1 and got.generation == c.generation
                assert any(rid == f"q{i}" for rid, *_ in got.app["requests"])
        finally:
            channel.close()
            srv.stop(grace=2)
            for sid in [k for k in smol_engine.chains.chains if str(k).endswith("/sync")]:
                smol_engine.end_session(sid)

    def test_7_a_retry_after_failover_is_replayed(self, side):
        srv, stub, _, _ = side
        sid = "failover"
        original = run(stub, req(sid, "Name a fruit.", request_id="f-1", expected_turn_index=0))
        committed(stub, sid)
        drop_here(srv, sid)  # the reply was lost; the retry lands on a replica without the session
        retry = run(stub, req(sid, "Name a fruit.", request_id="f-1", expected_turn_index=0))
        assert retry.replayed and retry.token_ids == original.token_ids and retry.turn_index == 0
        # a new request with a stale index is still refused
        assert (
            code_of(lambda: run(stub, req(sid, "x", request_id="f-2", expected_turn_index=0))) == C.FAILED_PRECONDITION
        )

    @pytest.mark.parametrize("depth", [65, 5000, 100000])
    def test_8_deep_json_is_invalid_argument(self, side, depth):
        _, stub, _, _ = side
        deep = "[" * depth + "]" * depth
        tool = pb.Tool(name="f", parameters_json='{"type": "object", "x": ' + deep + "}")
        r = req("deep-json", "hi")
        r.tools.append(tool)
        assert code_of(lambda: run(stub, r)) == C.INVALID_ARGUMENT
        call = pb.Message(
            role="assistant",
            content="",
            tool_calls=[pb.ToolCall(id="c", name="f", arguments_json='{"a": ' + deep + "}")],
        )
        r = req("deep-json-2", "hi")
        r.messages.insert(0, call)
        assert code_of(lambda: run(stub, r)) == C.INVALID_ARGUMENT

    def test_9_oversized_text_is_refused_before_tokenizing(self, side, smol_engine):
        _, stub, _, channel = side
        limit = 16 * smol_engine.max_model_len
        assert code_of(lambda: run(stub, req("big", "word " * (limit // 5 + 10)))) == C.INVALID_ARGUMENT
        many = pb.TurnRequest(
            session_id="many", max_tokens=2, messages=[pb.Message(role="user", content="x" * 15000) for _ in range(256)]
        )
        assert code_of(lambda: stub.Turn(many, metadata=ALPHA).__next__()) in (C.INVALID_ARGUMENT, C.RESOURCE_EXHAUSTED)
        assert code_of(lambda: run(stub, req("stop", "hi", stop=["s" * 2_000_000]))) in (
            C.INVALID_ARGUMENT,
            C.RESOURCE_EXHAUSTED,
        )
        assert code_of(lambda: run(stub, req("stop2", "hi", stop=["s" * 300]))) == C.INVALID_ARGUMENT
        assert serving(channel)

    def test_10_a_request_id_reused_for_other_content_is_refused(self, side):
        _, stub, _, _ = side
        first = run(stub, req("rid", "Name a fruit.", request_id="same"))
        again = run(stub, req("rid", "Name a fruit.", request_id="same"))
        assert again.replayed and again.token_ids == first.token_ids
        assert code_of(lambda: run(stub, req("rid", "Name a vegetable.", request_id="same"))) == C.FAILED_PRECONDITION
        assert (
            code_of(lambda: run(stub, req("rid", "Name a fruit.", request_id="same", max_tokens=9)))
            == C.FAILED_PRECONDITION
        )
