"""Security and durability of the session stores (issue 18, classes 1-3), against a real folder and a
real redis-server:

* any tenant / session id bytes map inside the directory store's root, and deleting a session removes
  only the files the store wrote (hypothesis fuzzes the ids);
* ids made of dots are refused at the API;
* a rolled-back meta (an older, validly signed record put back) is refused (SnapshotRolledBack ->
  DATA_LOSS), with and without an HMAC key, and the fence itself cannot be forged downwards;
* the snapshot writer tells "the store is older or empty" (keep the session, rewrite the store) from
  "another replica is newer" (stale).
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sidecar.store.integrity import SnapshotKeys, SnapshotRejected
from sidecar.session_ids import BadSessionId, check_id, scoped_key
from sidecar.sessions.record import Session
from sidecar.sessions.snapshots import SnapshotWriter, store_regressed
from sidecar.store import DirectoryStore, GenerationConflict, RedisStore, SnapshotRolledBack, StoredSession, folder_name


KEY = b"s" * 32


@pytest.fixture(params=["directory", "redis", "directory-hmac", "redis-hmac"])
def store(request, tmp_path):
    keys = SnapshotKeys([KEY]) if request.param.endswith("hmac") else None
    if request.param.startswith("directory"):
        yield DirectoryStore(tmp_path / "root", chunk_bytes=1000, hmac_keys=keys)
        return
    proc = request.getfixturevalue("redis_proc")
    s = RedisStore(proc.url, prefix=f"sec{time.monotonic_ns()}", chunk_bytes=1000, hmac_keys=keys)
    yield s
    s.close()


def record(key: str, generation: int, turn: int | None = None, blob: bytes | None = None) -> StoredSession:
    rec = {
        "session_id": key,
        "generation": generation,
        "turn_index": generation if turn is None else turn,
        "tokens": bytes(range(8)) * generation,
        "digest": "d",
        "fingerprint": "m|x",
        "method": {"method": "dense"},
    }
    return StoredSession(record=rec, app={"requests": [[f"r{generation}", b"c"]]}, kv=blob)


def tree(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


# --- 1. path traversal ---------------------------------------------------------------------------------
_ANY_TEXT = st.text(st.characters(blacklist_categories=("Cs",)), min_size=0, max_size=300)
_NASTY = st.sampled_from(
    [
        "..",
        ".",
        "../..",
        "../../etc/passwd",
        "/",
        "//",
        "a/../..",
        "..\\..",
        "\x00",
        "~",
        "%2e%2e",
        "%2e%2e%2f",
        "...",
        "a" * 5000,
        "con",
        "nul",
        ".lock",
        "meta",
        "kv.1.0",
    ]
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(tenant=st.one_of(_NASTY, _ANY_TEXT), sid=st.one_of(_NASTY, _ANY_TEXT))
def test_fuzzed_ids_never_leave_the_directory_store(tmp_path, tenant, sid):
    outside = tmp_path / "outside"
    outside.mkdir(exist_ok=True)
    (outside / "victim").write_bytes(b"keep me")
    root = tmp_path / "store" / "root"
    store = DirectoryStore(root, chunk_bytes=64)
    before_parent = tree(tmp_path)
    key = f"{tenant}/{sid}" if tenant else sid
    store.save(key, record(key, 1, blob=os.urandom(200)), None)
    assert store.load(key).kv is not None
    # everything written is in one folder directly inside the root, named from the key's hash
    new = tree(tmp_path) - before_parent
    assert new and all(p.startswith("store/root/" + folder_name(key)) for p in new), new
    assert store.folder(key).parent == root
    assert store.delete(key)
    assert tree(tmp_path) == before_parent  # delete took away exactly what save added
    assert (outside / "victim").read_bytes() == b"keep me"


def test_delete_leaves_files_it_did_not_write(tmp_path):
    store = DirectoryStore(tmp_path / "root")
    store.save("t/s", record("t/s", 1, blob=b"x" * 10), None)
    foreign = store.folder("t/s") / "not-ours.txt"
    foreign.write_text("an operator's note")
    assert store.delete("t/s")
    assert foreign.read_text() == "an operator's note"
    assert not (store.folder("t/s") / "meta").exists()
    # the sweep never touches folders it did not make
    (tmp_path / "root" / "..hidden").mkdir()
    (tmp_path / "root" / "..hidden" / "meta").write_bytes(b"\x80")
    store.sweep()
    assert (tmp_path / "root" / "..hidden" / "meta").exists()


@pytest.mark.parametrize("sid", [".", "..", "...", "." * 128])
def test_dot_ids_are_refused(sid):
    with pytest.raises(BadSessionId):
        check_id(sid)
    with pytest.raises(BadSessionId):
        scoped_key("tenant", sid)


@given(st.text(st.sampled_from("._-aZ9"), min_size=1, max_size=20))
def test_id_check_refuses_exactly_the_dot_only_ids(sid):
    if set(sid) == {"."}:
        with pytest.raises(BadSessionId):
            check_id(sid)
    else:
        assert check_id(sid) == sid


# --- 3. rollback ---------------------------------------------------------------------------------------
def _snapshot_meta(store, key) -> dict:
    return dict(store._read_meta(key))


def _put_meta(store, key, fields: dict) -> None:
    import msgpack

    if isinstance(store, DirectoryStore):
        (store.folder(key) / "meta").write_bytes(
            msgpack.packb(
                {(k if isinstance(k, bytes) else k.encode()): v for k, v in fields.items()}, use_bin_type=True
            )
        )
    else:
        store.client.delete(store.meta_key(key))
        store.client.hset(store.meta_key(key), mapping=fields)


@pytest.mark.parametrize("back", [1, 2, 5])
def test_a_rolled_back_record_is_refused(store, back):
    key = "alpha/rb"
    store.save(key, record(key, 1, blob=os.urandom(1500)), None)
    old = {1: _snapshot_meta(store, key)}
    for g in range(2, 7):
        store.save(key, record(key, g, blob=os.urandom(1500)), g - 1)
        old[g] = _snapshot_meta(store, key)
    assert store.load(key).generation == 6 and store.fence(key) == 6
    _put_meta(store, key, old[6 - back])  # a validly signed, older record put back
    with pytest.raises(SnapshotRolledBack) as e:
        store.load(key)
    assert e.value.found == 6 - back and e.value.fence == 6
    # a writer can never commit below the fence either
    with pytest.raises(GenerationConflict) as c:  # (a replica resuming from the rolled-back record)
        store.save(key, record(key, 6 - back), 6 - back)
    assert c.value.fenced and c.value.found == 6
    # the holder of generation 6 rewrites the store on what it finds there: a newer commit goes in
    store.save(key, record(key, 7), 6 - back)
    assert store.load(key, with_kv=False).generation == 7 and store.fence(key) == 7


def test_a_forged_fence_is_refused_with_hmac(redis_proc):
    store = RedisStore(redis_proc.url, prefix=f"ff{time.monotonic_ns()}", hmac_keys=SnapshotKeys([KEY]))
    key = "alpha/f"
    store.save(key, record(key, 1), None)
    store.save(key, record(key, 2), 1)
    old = _snapshot_meta(store, key)
    store.save(key, record(key, 3), 2)
    _put_meta(store, key, old)
    for forged in (b"2", b"2.deadbeef", store.fence_value("alpha/other", 2)):
        store.client.set(store.fence_key(key), forged)
        with pytest.raises(SnapshotRejected):
            store.load(key)
    store.close()


def test_fence_and_meta_expire_and_delete_together(redis_proc):
    store = RedisStore(redis_proc.url, prefix=f"fx{time.monotonic_ns()}", ttl_s=300)
    store.save("k", record("k", 1), None)
    assert 0 < store.client.ttl(store.fence_key("k")) <= 300
    assert store.delete("k") and store.client.get(store.fence_key("k")) is None
    store.save("k", record("k", 1), None)  # a new session under the same id starts over
    assert store.load("k").generation == 1
    store.close()


# --- 2. a store that lost data or went back in time ------------------------------------------------------
def test_regression_is_told_apart_from_a_newer_replica():
    assert store_regressed(5, GenerationConflict("k", 5, None))  # emptied
    assert store_regressed(5, GenerationConflict("k", 5, 4))  # one generation back
    assert not store_regressed(5, GenerationConflict("k", 5, 6))  # another replica moved on
    assert not store_regressed(5, GenerationConflict("k", 5, 3, fenced=True))  # the fence says newer exists
    assert not store_regressed(None, GenerationConflict("k", None, 1))  # someone else created it


class _FakeEngineClient:
    """The writer's view of the engine (sidecar.engine_bridge.client.EngineClient): a fixed session snapshot."""

    def __init__(self, generation: int, turn: int):
        from engine.cache.snapshot import SessionSnapshot

        meta = {
            "session_id": "t/s",
            "generation": generation,
            "turn_index": turn,
            "tokens": bytes(range(8)),
            "digest": "d",
            "fingerprint": "m|x",
            "method": {"method": "dense"},
        }
        self.snap = SessionSnapshot(meta=meta, kv=None)

    async def snapshot(self, key, with_kv=True):
        return self.snap


class _Sessions:
    def __init__(self, s):
        self.s = s

    def local(self, key):
        return self.s

    def all(self):
        return [self.s]


@pytest.mark.parametrize("what", ["emptied", "one_back", "restored_backup"])
def test_holder_rewrites_a_store_that_lost_its_session(store, what):
    key = "t/s"
    for g in range(1, 5):
        store.save(key, record(key, g), g - 1 if g > 1 else None)
    backup = _snapshot_meta(store, key)
    store.save(key, record(key, 5), 4)
    if what == "emptied":  # redis restarted without persistence / the folder was wiped
        store.delete(key)
    elif what == "one_back":  # a replica promoted from a copy one commit behind (the fence survived)
        _put_meta(store, key, backup)
    else:  # an old backup restored over everything, fence included
        store.delete(key)
        store.save(key, record(key, 2), None)
    s = Session(key=key, in_engine=True, generation=6, turn_index=6, committed_generation=5)
    writer = SnapshotWriter(store, _FakeEngineClient(6, 6), with_kv=False)
    writer.attach(_Sessions(s))
    asyncio.run(writer.write(key))
    assert not s.stale and s.committed_generation == 6 and s.snapshot_error is None
    got = store.load(key, with_kv=False)
    assert got.generation == 6 and got.turn_index == 6  # never backwards
    assert writer.rewrites == 1


def test_a_newer_replica_marks_the_local_copy_stale(store):
    key = "t/s"
    for g in range(1, 4):
        store.save(key, record(key, g), g - 1 if g > 1 else None)
    s = Session(key=key, in_engine=True, generation=3, turn_index=3, committed_generation=2)
    writer = SnapshotWriter(store, _FakeEngineClient(3, 3), with_kv=False)
    writer.attach(_Sessions(s))
    asyncio.run(writer.write(key))
    assert s.stale and "generation 3" in s.snapshot_error and writer.rewrites == 0
    assert store.load(key, with_kv=False).app == record(key, 3).app  # the other replica's commit stands


def test_sessions_of_the_quoted_layout_are_moved_to_their_hashed_folder(tmp_path):
    import urllib.parse

    root = tmp_path / "root"
    old = DirectoryStore(root)
    old.save("t/s.1", record("t/s.1", 1, blob=os.urandom(300)), None)
    legacy = root / urllib.parse.quote("t/s.1", safe="")
    old.folder("t/s.1").rename(legacy)  # as an earlier version laid it out
    (root / "not-a-session").mkdir()
    store = DirectoryStore(root)
    assert store.migrated == 1 and not legacy.exists()
    got = store.load("t/s.1")
    assert got.generation == 1 and got.kv is not None and got.kv_error is None
    assert (root / "not-a-session").is_dir()
