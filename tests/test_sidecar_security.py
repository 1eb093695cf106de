"""Security and observability of the sidecar below the server, on a real redis-server.

Store level: HMAC-signed snapshots (a tampered store is refused, never loaded) and key files. Then
JSON logs and serve settings from flags / env / YAML. The servers under attack are in
test_sidecar_security_tenants.py (tenant isolation, limits, metrics) and
test_sidecar_security_adversarial.py (the adversarial review's classes of break).
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os

import msgpack
import pytest

from security_fixtures import KEY
from sidecar.store import DirectoryStore, RedisStore, StoredSession
from sidecar.store.integrity import SnapshotKeys, SnapshotRejected


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
