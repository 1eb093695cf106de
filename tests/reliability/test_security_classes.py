"""Issue 18's classes of break, as reliability rows (benchmarks/reliability.py collects them):

* ``--durability sync``: a ``chainkv serve`` process SIGKILLed at the moment each completion reaches
  the client loses no acknowledged turn; a replica started afterwards continues each session at the
  next index (a lost turn would be FAILED_PRECONDITION, never a silently reused index);
* path traversal: hypothesis-fuzzed tenant and session ids against the directory store never put or
  remove a file outside the store's root;
* rollback: every older, validly signed record put back in place is refused, on both stores.

The sidecar-level checks of each class (SmolLM2 in process) are in tests/test_security_sidecar.py.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sidecar._proto.chainkv.v1 import sidecar_pb2 as pb
from sidecar.integrity import SnapshotKeys
from sidecar.store import DirectoryStore, RedisStore, SnapshotRolledBack, StoredSession

from redis_server import RedisProcess
from tests.sidecar_proc import ALPHA, Sidecar, request, run

pytestmark = [pytest.mark.slow, pytest.mark.reliability]

TURNS = [
    [("system", "You are a concise assistant."), ("user", "Name three fruits.")],
    [("user", "Which of them is yellow?")],
    [("user", "Thanks. Name one more fruit.")],
]


@pytest.fixture(scope="module")
def redis_proc(tmp_path_factory):
    proc = RedisProcess(tmp_path_factory.mktemp("redis-aof"), aof=True).start()
    yield proc
    proc.stop()


def _record(key: str, generation: int) -> StoredSession:
    rec = {"session_id": key, "generation": generation, "turn_index": generation, "tokens": b"\x01\x00\x00\x00",
           "digest": "d", "fingerprint": "m|x", "method": {"method": "dense"}}
    return StoredSession(record=rec, app={"requests": [[f"r{generation}", b"done"]]})


def test_sync_durability_loses_no_acknowledged_turn_to_sigkill(redis_proc, reliability_report):
    sessions, kills = ["d1", "d2"], 0
    proc = Sidecar(redis_proc.url, "--durability", "sync").start().wait_ready()
    try:
        for t, turn in enumerate(TURNS):
            for sid in sessions:
                done = run(proc.stub, request(sid, turn, request_id=f"{sid}-{t}", expected_turn_index=t))
                assert done.turn_index == t
                if sid == sessions[-1]:  # killed the instant the last completion arrived (0 ms)
                    assert proc.kill() == -signal.SIGKILL
                    kills += 1
                    proc = Sidecar(redis_proc.url, "--durability", "sync").start().wait_ready()
            for sid in sessions:  # the new replica continues each session where the client left it
                info = proc.stub.Resume(pb.ResumeRequest(session_id=sid, expected_turn_index=t + 1), metadata=ALPHA)
                assert info.turn_index == t + 1
    finally:
        proc.stop()
    reliability_report["faults"].append({"fault": "SIGKILL sidecar at 0 ms after each completion (--durability sync)",
                                         "count": kills, "sessions": len(sessions), "sessions_lost": 0,
                                         "committed_turns_lost": 0, "acknowledged_turns_lost": 0})


def test_fuzzed_ids_stay_inside_the_directory_store(tmp_path_factory, reliability_report):
    base = tmp_path_factory.mktemp("traversal")
    (base / "sibling").mkdir()
    (base / "sibling" / "victim").write_bytes(b"keep")
    store = DirectoryStore(base / "store", chunk_bytes=64)
    inputs = {"n": 0}
    ids = st.one_of(st.sampled_from(["..", ".", "../..", "../sibling", "../sibling/victim", "/", "a/../../b",
                                     "%2e%2e", "\x00", "..\\..", ".lock", "meta"]), st.text(max_size=200))

    def outside() -> set[str]:
        return {str(p.relative_to(base)) for p in base.rglob("*") if not str(p.relative_to(base)).startswith("store")}

    before = outside()

    @settings(max_examples=int(os.environ.get("CHAINKV_FUZZ_EXAMPLES", "0")) or 400, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow])
    @given(tenant=ids, sid=ids)
    def check(tenant, sid):
        key = f"{tenant}/{sid}"
        store.save(key, _record(key, 1), None)
        assert store.load(key, with_kv=False).generation == 1
        assert store.delete(key)
        assert outside() == before
        assert [p.parent for p in (base / "store").iterdir()] in ([], [base / "store"])
        inputs["n"] += 1

    check()
    assert (base / "sibling" / "victim").read_bytes() == b"keep"
    reliability_report["fuzz"]["directory_store_ids"] = {"inputs": inputs["n"], "crashes": 0,
                                                         "files_outside_root": 0}


@pytest.mark.parametrize("kind", ["directory", "redis"])
def test_every_rolled_back_signed_record_is_refused(kind, tmp_path, redis_proc, reliability_report):
    keys = SnapshotKeys([b"r" * 32])
    store = (DirectoryStore(Path(tmp_path) / "s", hmac_keys=keys) if kind == "directory"
             else RedisStore(redis_proc.url, prefix=f"rb{os.getpid()}", hmac_keys=keys))
    key, n, refused = "alpha/rb", 12, 0
    metas = {}
    for g in range(1, n + 1):
        store.save(key, _record(key, g), g - 1 if g > 1 else None)
        metas[g] = dict(store._read_meta(key))
    for g in range(1, n):
        if kind == "directory":
            import msgpack

            (store.folder(key) / "meta").write_bytes(msgpack.packb(metas[g], use_bin_type=True))
        else:
            store.client.delete(store.meta_key(key))
            store.client.hset(store.meta_key(key), mapping=metas[g])
        with pytest.raises(SnapshotRolledBack):
            store.load(key)
        refused += 1
    reliability_report["tampering"].append({"attack": f"validly signed older record put back ({kind} store)",
                                            "attempts": n - 1, "refused": refused, "served": n - 1 - refused})
