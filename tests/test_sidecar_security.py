"""Security and observability of the sidecar: HMAC-signed snapshots (a tampered store is refused, never
loaded), tenant isolation on every RPC, per-tenant limits with their status codes, Prometheus
metrics on the side port, JSON logs, serve settings from flags / env / YAML."""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import urllib.request

import grpc
import msgpack
import pytest

from sidecar._proto.chainkv.v1 import sidecar_pb2 as pb
from sidecar._proto.chainkv.v1 import sidecar_pb2_grpc
from sidecar.integrity import SnapshotKeys, SnapshotRejected
from sidecar.store import DirectoryStore, RedisStore, StoredSession


C = grpc.StatusCode
KEY = b"k" * 32
TOKENS = {"tok-alpha": "alpha", "tok-beta": "beta"}
ALPHA = [("authorization", "Bearer tok-alpha")]
BETA = [("authorization", "Bearer tok-beta")]


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


# --- the server ----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(smol_engine, redis_proc, tmp_path_factory):
    from sidecar.auth import Authenticator
    from sidecar.limits import TenantLimits
    from sidecar.metrics import MetricsHooks
    from sidecar.server import ServerOptions, ServerThread

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


def code_of(fn) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as e:
        fn()
    return e.value.code()


def wait_committed(stub, sid, metadata=ALPHA):
    import time

    for _ in range(400):
        s = stub.GetSession(pb.GetSessionRequest(session_id=sid), metadata=metadata)
        if s.snapshot_state == pb.SNAPSHOT_STATE_COMMITTED and s.committed_generation == s.generation:
            return s
        time.sleep(0.05)
    raise AssertionError("snapshot not committed")


def wait_idle(stub, sid, metadata=ALPHA):
    import time

    for _ in range(400):
        if stub.GetSession(pb.GetSessionRequest(session_id=sid), metadata=metadata).state != pb.SESSION_STATE_ACTIVE:
            return
        time.sleep(0.05)
    raise AssertionError("the session stayed active")


def test_tenants_cannot_touch_each_others_sessions(server):
    srv, stub, store, _ = server
    first = turn(stub, "shared-id", "Name a colour.")
    before = wait_committed(stub, "shared-id")
    rid_req = pb.TurnRequest(
        session_id="shared-id",
        request_id="r-1",
        max_tokens=4,
        messages=[pb.Message(role="user", content="Another colour?")],
    )
    list(stub.Turn(rid_req, metadata=ALPHA))
    before = wait_committed(stub, "shared-id")
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
    assert (after.turn_index, after.generation, after.digest) == (before.turn_index, before.generation, before.digest)
    # alpha's session is still there in the store, under alpha's key only
    assert store.load("alpha/shared-id", with_kv=False).turn_index == 2
    for sid, md in (("shared-id", ALPHA), ("shared-id", BETA)):
        stub.EndSession(pb.EndSessionRequest(session_id=sid), metadata=md)
    assert first.turn_index == 0


def test_tampered_snapshot_is_refused_with_data_loss(server, smol_engine):
    srv, stub, store, _ = server
    turn(stub, "victim", "Say hello.")
    wait_committed(stub, "victim")
    stub.EndSession(pb.EndSessionRequest(session_id="victim", keep_snapshot=True), metadata=ALPHA)  # only in Redis now
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


def test_tenant_limits(server):
    srv, stub, _, _ = server
    turn(stub, "qs", "Hi.", max_tokens=2)  # a session only in the store: resuming it would hold one more
    wait_committed(stub, "qs")
    stub.EndSession(pb.EndSessionRequest(session_id="qs", keep_snapshot=True), metadata=ALPHA)
    for i in range(3):
        turn(stub, f"q{i}", "Hi.", max_tokens=2)
    assert code_of(lambda: turn(stub, "q3", "Hi.", max_tokens=2)) == C.RESOURCE_EXHAUSTED
    assert (
        code_of(lambda: stub.ForkSession(pb.ForkSessionRequest(session_id="q0", new_session_id="q0b"), metadata=ALPHA))
        == C.RESOURCE_EXHAUSTED
    )
    assert turn(stub, "q1", "Again.", max_tokens=2).turn_index == 1  # existing sessions carry on
    assert turn(stub, "b0", "Hi.", max_tokens=2, metadata=BETA).turn_index == 0  # another tenant's quota
    assert turn(stub, "b1", "Hi.", max_tokens=2, metadata=BETA).turn_index == 0
    assert code_of(lambda: turn(stub, "b2", "Hi.", max_tokens=2, metadata=BETA)) == C.RESOURCE_EXHAUSTED  # its own: 2
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
    from sidecar.limits import TenantLimits, parse_overrides

    assert parse_overrides(["batch:max_sessions_per_tenant=5,max_tokens_per_turn=9", "x:max_tokens_per_turn=2"]) == {
        "batch": {"max_sessions_per_tenant": 5, "max_tokens_per_turn": 9},
        "x": {"max_tokens_per_turn": 2},
    }
    for bad in (["batch"], ["batch:max_sessions_per_tenant"], ["b:max_sessions_per_tenant=x"]):
        with pytest.raises(ValueError):
            parse_overrides(bad)
    with pytest.raises(ValueError, match="unknown tenant limit"):
        TenantLimits(overrides={"b": {"max_session": 1}})


def test_metrics_on_the_side_port(server):
    srv, stub, _, metrics_port = server
    turn(stub, "m", "Name a planet.", max_tokens=5, ignore_eos=True)
    turn(stub, "m", "And another.", max_tokens=5, ignore_eos=True)
    wait_committed(stub, "m")
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


def test_json_logs_carry_the_request_context():
    from sidecar.logs import JsonFormatter, bind_request

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
    from sidecar.cli import build_parser
    from sidecar.serve_config import load_serve_settings

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
