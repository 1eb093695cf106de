"""Session stores (a real redis-server and a local folder): chunked KV with checksums, commits on
the expected generation, TTLs, and a session snapshot that round-trips into another engine."""

from __future__ import annotations

import os
import time

import pytest

from sidecar.store import DirectoryStore, GenerationConflict, RedisStore, StoredSession, open_store

from tests.conftest import make_engine, run_turn


@pytest.fixture(params=["directory", "redis"])
def store(request, tmp_path):
    if request.param == "directory":
        yield DirectoryStore(tmp_path / "sessions", chunk_bytes=1000)
        return
    redis_proc = request.getfixturevalue("redis_proc")
    s = RedisStore(redis_proc.url, prefix=f"t{time.monotonic_ns()}", chunk_bytes=1000)
    yield s
    s.close()


def session(generation: int, turn: int = 1, blob: bytes | None = None) -> StoredSession:
    record = {
        "session_id": "tenant/s1",
        "generation": generation,
        "turn_index": turn,
        "tokens": bytes(range(16)),
        "digest": "abc",
        "fingerprint": "model|x",
        "spans": [[0, 4, "user", 0, False]],
        "method": {"method": "dense", "budget": None, "budget_ratio": None, "method_args": {}},
    }
    return StoredSession(record=record, app={"requests": [["r1", b"\x00\x01"]]}, kv=blob)


def chunk_names(store, key: str) -> list[str]:
    if isinstance(store, DirectoryStore):
        d = store.folder(key)
        return sorted(p.name for p in d.iterdir() if p.name.startswith("kv.")) if d.exists() else []
    return sorted(k.decode() for k in store.client.scan_iter(f"{store.prefix}:{{{key}}}:kv:*"))


def test_round_trip_conflicts_and_old_chunks(store):
    key = "tenant/s1"
    blob = os.urandom(3500)
    store.save(key, session(1, blob=blob), expected_generation=None)
    got = store.load(key)
    assert got.kv == blob and got.kv_error is None and got.generation == 1
    assert got.record == session(1).record and got.app == {"requests": [["r1", b"\x00\x01"]]}
    assert len(chunk_names(store, key)) == 4  # 3500 bytes in 1000-byte chunks
    assert store.load(key, with_kv=False).kv is None
    with pytest.raises(GenerationConflict):  # a second "new" session under the same id
        store.save(key, session(1, blob=blob), expected_generation=None)
    with pytest.raises(GenerationConflict):  # a writer that missed generation 1
        store.save(key, session(2, blob=blob), expected_generation=0)
    blob2 = os.urandom(1500)
    store.save(key, session(2, turn=2, blob=blob2), expected_generation=1)
    got = store.load(key)
    assert got.kv == blob2 and got.turn_index == 2
    names = chunk_names(store, key)
    assert len(names) == 2 and all(":2." in n or ".2." in n for n in names)  # generation 1's chunks are gone
    store.save(key, session(3, turn=3), expected_generation=2)  # history only
    got = store.load(key)
    assert got.kv is None and got.kv_error is None and chunk_names(store, key) == []
    assert store.delete(key) and store.load(key) is None and not store.delete(key)


def test_a_damaged_or_missing_chunk_is_reported_not_loaded(store):
    key = "s2"
    store.save(key, session(1, blob=os.urandom(2500)), expected_generation=None)
    name = chunk_names(store, key)[1]
    if isinstance(store, DirectoryStore):
        path = store.folder(key) / name
        data = bytearray(path.read_bytes())
        data[10] ^= 0xFF
        path.write_bytes(bytes(data))
    else:
        old = store.client.getrange(name, 10, 10)
        store.client.setrange(name, 10, bytes([old[0] ^ 0xFF]))
    got = store.load(key)
    assert got.kv is None and "fails its sha256 checksum" in got.kv_error and got.generation == 1
    if isinstance(store, DirectoryStore):
        (store.folder(key) / name).unlink()
    else:
        store.client.delete(name)
    got = store.load(key)
    assert got.kv is None and "missing" in got.kv_error


def test_every_redis_key_expires(redis_proc):
    r = RedisStore(redis_proc.url, prefix="ttl", ttl_s=600, chunk_bytes=1000)
    r.save("s", session(1, blob=os.urandom(1200)), expected_generation=None)
    keys = list(r.client.scan_iter("ttl:*"))
    assert len(keys) == 4 and all(0 < r.client.ttl(k) <= 600 for k in keys)  # meta, fence, 2 chunks


def test_directory_sessions_expire(tmp_path, monkeypatch):
    from sidecar.store import directory_store

    now = [1_000_000.0]  # the store's clock, moved by hand: no sleep, no race with a loaded machine
    monkeypatch.setattr(directory_store.time, "time", lambda: now[0])
    d = DirectoryStore(tmp_path, ttl_s=60)
    d.save("s", session(1, blob=b"x"), expected_generation=None)
    now[0] += 59
    assert d.load("s") is not None
    now[0] += 2
    assert d.load("s") is None and d.sweep() == 1 and not d.folder("s").exists()
    # an expired session no longer blocks a new one under its id
    d.save("s", session(1), expected_generation=None)


def test_open_store_urls(tmp_path):
    assert isinstance(open_store("redis://127.0.0.1:1/0"), RedisStore)  # connects lazily
    assert isinstance(open_store(f"file://{tmp_path}/a"), DirectoryStore)
    assert open_store(str(tmp_path / "b")).root == tmp_path / "b"
    assert open_store("none") is None
    with pytest.raises(ValueError):
        open_store("s3://bucket")


def test_engine_session_round_trips_through_the_directory_store(tiny_models, tmp_path):
    """A session snapshot, split into record + KV chunks, written, read back and loaded into a
    second engine, continues exactly like the original; with its KV damaged it is rebuilt."""
    from engine.sampling import SamplingParams
    from sidecar.sessions.snapshot_codec import join_snapshot, split_snapshot

    folder, _ = tiny_models("llama")
    params = SamplingParams(max_tokens=6)

    a, b, c = (make_engine(folder, num_pages=600, prefill_chunk_size=16) for _ in range(3))
    run_turn(a, "s", list(range(5, 40)), params)
    store = DirectoryStore(tmp_path, chunk_bytes=4096)
    stored = split_snapshot(a.snapshot_session("s"), {"tools_digest": ""})
    assert stored.kv is not None and "tokens" in stored.record and "num_cached" not in stored.record
    store.save("s", stored, expected_generation=None)
    snap, err = join_snapshot(store.load("s"))
    assert err is None
    b.load_session(snap)
    nxt = list(range(50, 60))
    here, there = run_turn(a, "s", nxt, params), run_turn(b, "s", nxt, params)
    assert there.source_tier == "store" and there.token_ids == here.token_ids
    chunk = sorted(p for p in store.folder("s").iterdir() if p.name.startswith("kv."))[0]
    data = bytearray(chunk.read_bytes())
    data[-1] ^= 0x55
    chunk.write_bytes(bytes(data))
    snap, err = join_snapshot(store.load("s"))
    assert snap.kv is None and "checksum" in err
    c.load_session(snap)
    rebuilt = run_turn(c, "s", nxt, params)
    assert rebuilt.source_tier == "recompute" and rebuilt.token_ids == here.token_ids
