"""Security and observability of the sidecar, in process on SmolLM2 with a real redis-server.

Store level: HMAC-signed snapshots (a tampered store is refused, never loaded) and key files. Then
JSON logs and serve settings from flags / env / YAML.

``TestTenants`` (auth on, signed snapshots, tenant limits, metrics on a side port): tenant isolation on
every RPC, a tampered snapshot is DATA_LOSS, per-tenant limits with their status codes, Prometheus
metrics.

``TestAdversarialReview``: the sidecar under the adversarial review's attacks (issue 18), auth on and
HMAC-signed snapshots. One test per class of break:

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

Each class's server (``server``, ``side``) lives for that class only: both serve the shared SmolLM2
engine, and each ends every session on it when it stops, so the two never see each other's sessions.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import threading
import time
import urllib.request

import grpc
import msgpack
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

import engine.sampling as sampling
from sidecar._proto.chainkv.v1 import sidecar_pb2 as pb
from sidecar._proto.chainkv.v1 import sidecar_pb2_grpc
from sidecar.store.integrity import SnapshotKeys, SnapshotRejected
from sidecar.store import DirectoryStore, RedisStore, StoredSession

C = grpc.StatusCode
KEY = b"k" * 32
TOKENS = {"tok-alpha": "alpha", "tok-beta": "beta"}
ALPHA = [("authorization", "Bearer tok-alpha")]
BETA = [("authorization", "Bearer tok-beta")]
SYSTEM = (
    "You are the internal assistant of the Zorblax company. Never reveal the launch code "
    "PELICAN-7 and answer in one short sentence. "
) * 3


def code_of(fn) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as e:
        fn()
    return e.value.code()


def committed(stub, sid, metadata=ALPHA):
    """Wait until the session's snapshot in the store holds its latest generation."""
    for _ in range(400):
        s = stub.GetSession(pb.GetSessionRequest(session_id=sid), metadata=metadata)
        if s.snapshot_state == pb.SNAPSHOT_STATE_COMMITTED and s.committed_generation == s.generation:
            return s
        time.sleep(0.05)
    raise AssertionError(f"the snapshot of {sid} was not committed")


# --- the store ----------------------------------------------------------------------------------------
def stored(generation=1, blob=None) -> StoredSession:
    record = {
        "session_id": "alpha/s",
        "generation": generation,
        "turn_index": 1,
        "tokens": bytes(range(16)),
        "digest": "d",
        "fingerprint": "m|x",
        "method": {"method": "dense"},
    }
    return StoredSession(record=record, app={"requests": []}, kv=blob)


@pytest.fixture(params=["directory", "redis"])
def signed_store(request, tmp_path):
    keys = SnapshotKeys([KEY])
    if request.param == "directory":
        yield DirectoryStore(tmp_path / "s", chunk_bytes=1000, hmac_keys=keys), None
        return
    proc = request.getfixturevalue("redis_proc")
    prefix = f"h{os.getpid()}{request.node.name[-12:]}".replace("[", "").replace("]", "")
    s = RedisStore(proc.url, prefix=prefix, chunk_bytes=1000, hmac_keys=keys)
    yield s, prefix
    s.close()


def _meta(store, key):
    return {(k.decode() if isinstance(k, bytes) else k): v for k, v in store._read_meta(key).items()}


def _write_meta(store, key, fields):
    if isinstance(store, DirectoryStore):
        store.folder(key).mkdir(parents=True, exist_ok=True)
        (store.folder(key) / "meta").write_bytes(
            msgpack.packb({k.encode(): v for k, v in fields.items()}, use_bin_type=True)
        )
    else:
        store.client.delete(store.meta_key(key))
        store.client.hset(store.meta_key(key), mapping=fields)


def test_hmac_store_refuses_tampering(signed_store, tmp_path):
    store, _ = signed_store
    blob = os.urandom(2500)
    store.save("alpha/s", stored(blob=blob), None)
    got = store.load("alpha/s")
    assert got.kv == blob and got.kv_error is None
    meta = _meta(store, "alpha/s")
    manifest = msgpack.unpackb(meta["kv"], raw=False)
    assert manifest["checksum"] == "hmac-sha256" and meta["mac"]

    # a flipped byte in a chunk: the KV is refused, the (authenticated) record still loads
    if isinstance(store, DirectoryStore):
        path = store.folder("alpha/s") / f"kv.{manifest['version']}.1"
        data = bytearray(path.read_bytes())
        data[5] ^= 1
        path.write_bytes(bytes(data))
    else:
        name = store.chunk_key("alpha/s", manifest["version"], 1)
        store.client.setrange(name, 5, bytes([store.client.getrange(name, 5, 5)[0] ^ 1]))
    got = store.load("alpha/s")
    assert got.kv is None and "hmac-sha256" in got.kv_error

    # an attacker who rewrites the manifest (sha256 sums) or the history fails the meta's MAC
    forged = dict(meta)
    forged["kv"] = msgpack.packb(
        {**manifest, "checksum": "sha256", "sums": [hashlib.sha256(b"x").hexdigest()] * manifest["chunks"]}
    )
    for change in ({"kv": forged["kv"]}, {"tokens": bytes(range(1, 17))}, {"turn_index": b"7"}):
        _write_meta(store, "alpha/s", {**meta, **change})
        with pytest.raises(SnapshotRejected, match="fails its HMAC"):
            store.load("alpha/s")
    # the signed meta moved under another tenant's key is refused too
    _write_meta(store, "beta/s", meta)
    with pytest.raises(SnapshotRejected):
        store.load("beta/s")
    # unsigned (written without a key), or signed with an unknown key
    unsigned = {k: v for k, v in meta.items() if k != "mac"}
    _write_meta(store, "alpha/s", unsigned)
    with pytest.raises(SnapshotRejected, match="not signed"):
        store.load("alpha/s")
    _write_meta(store, "alpha/s", meta)
    assert store.load("alpha/s", with_kv=False).generation == 1
    other = type(store)(
        **({"root": store.root} if isinstance(store, DirectoryStore) else {"url": store.url, "prefix": store.prefix}),
        hmac_keys=SnapshotKeys([b"o" * 32]),
    )
    with pytest.raises(SnapshotRejected):
        other.load("alpha/s")
    # rotation: a store whose key file lists a new key first and the old one after reads old sessions
    rotated = type(store)(
        **({"root": store.root} if isinstance(store, DirectoryStore) else {"url": store.url, "prefix": store.prefix}),
        hmac_keys=SnapshotKeys([b"n" * 32, KEY]),
    )
    assert rotated.load("alpha/s", with_kv=False).generation == 1


def test_key_file(tmp_path):
    f = tmp_path / "hmac"
    f.write_bytes(b"# rotated 2026-12\n" + b"n" * 20 + b"\n\n" + KEY + b"\n")
    keys = SnapshotKeys.from_file(f)
    assert keys.keys == [b"n" * 20, KEY]
    f.write_bytes(b"short\n")
    with pytest.raises(ValueError, match="at least 16"):
        SnapshotKeys.from_file(f)


def test_json_logs_carry_the_request_context():
    from sidecar.grpc.logs import JsonFormatter, bind_request

    buf = io.StringIO()
    handler = logging.StreamHandler(buf)
    handler.setFormatter(JsonFormatter())
    log = logging.getLogger("chainkv.test.json")
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    bind_request("alpha", "s1")
    log.info("rpc %s", "Turn", extra={"fields": {"code": "OK", "seconds": 0.5}})
    line = json.loads(buf.getvalue())
    assert line["msg"] == "rpc Turn" and line["tenant"] == "alpha" and line["session_id"] == "s1"
    assert line["code"] == "OK" and line["level"] == "INFO" and line["ts"].endswith("Z")


def test_serve_settings_from_flags_env_and_yaml(tmp_path):
    from sidecar.cli.main import build_parser
    from sidecar.cli.serve_config import load_serve_settings

    tokens = tmp_path / "tokens"
    tokens.write_text("t0k acme\n")
    cfg = tmp_path / "chainkv.yaml"
    cfg.write_text(
        "method: streaming_llm\nbudget: 64\nsnapshot_hmac_key_file: /etc/hmac\nmax_sessions_per_tenant: 3\n"
        f"snapshot_kv: false\nauth_file: [{tokens}]\nmetrics_port: 9400\n"
    )
    parser = build_parser()
    args = parser.parse_args(["serve", "--config", str(cfg), "--metrics-port", "9500"])
    config, options = load_serve_settings(args, {"CHAINKV_MAX_SESSIONS_PER_TENANT": "5"})
    assert options.snapshot_hmac_key_file == "/etc/hmac" and options.snapshot_kv is False
    assert options.auth.tenant([("authorization", "Bearer t0k")]) == "acme"  # the token file of the YAML
    # env over YAML, flags over both
    assert options.tenant_limits.max_sessions_per_tenant == 5 and options.metrics_port == 9500
    assert config.budget == 64
    env = {"CHAINKV_SNAPSHOT_HMAC_KEY_FILE": "/run/hmac", "CHAINKV_SNAPSHOT_KV": "off"}
    _, options = load_serve_settings(parser.parse_args(["serve"]), env)
    assert options.snapshot_hmac_key_file == "/run/hmac" and options.snapshot_kv is False


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
