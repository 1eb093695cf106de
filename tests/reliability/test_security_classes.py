"""Issue 18's classes of break, as reliability rows (benchmarks/reliability.py collects them):

* ``--durability sync``: a ``chainkv serve`` process SIGKILLed at the moment each completion reaches
  the client loses no acknowledged turn; a replica started afterwards continues each session at the
  next index (a lost turn would be FAILED_PRECONDITION, never a silently reused index);
* path traversal: hypothesis-fuzzed tenant and session ids against the directory store never put or
  remove a file outside the store's root;
* rollback: every older, validly signed record put back in place is refused, on both stores.

The sidecar-level checks of each class (SmolLM2 in process) are in tests/test_sidecar_security.py
(``TestAdversarialReview``).
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sidecar._proto.chainkv.v1 import sidecar_pb2 as pb
from sidecar.store.integrity import SnapshotKeys
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
    rec = {
        "session_id": key,
        "generation": generation,
        "turn_index": generation,
        "tokens": b"\x01\x00\x00\x00",
        "digest": "d",
        "fingerprint": "m|x",
        "method": {"method": "dense"},
    }
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
    reliability_report["faults"].append(
        {
            "fault": "SIGKILL sidecar at 0 ms after each completion (--durability sync)",
            "count": kills,
            "sessions": len(sessions),
            "sessions_lost": 0,
            "committed_turns_lost": 0,
            "acknowledged_turns_lost": 0,
        }
    )


def test_fuzzed_ids_stay_inside_the_directory_store(tmp_path_factory, reliability_report):
    base = tmp_path_factory.mktemp("traversal")
    (base / "sibling").mkdir()
    (base / "sibling" / "victim").write_bytes(b"keep")
    store = DirectoryStore(base / "store", chunk_bytes=64)
    inputs = {"n": 0}
    ids = st.one_of(
        st.sampled_from(
            [
                "..",
                ".",
                "../..",
                "../sibling",
                "../sibling/victim",
                "/",
                "a/../../b",
                "%2e%2e",
                "\x00",
                "..\\..",
                ".lock",
                "meta",
            ]
        ),
        st.text(max_size=200),
    )

    def outside() -> set[str]:
        return {str(p.relative_to(base)) for p in base.rglob("*") if not str(p.relative_to(base)).startswith("store")}

    before = outside()

    @settings(
        max_examples=int(os.environ.get("CHAINKV_FUZZ_EXAMPLES", "0")) or 400,
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.too_slow],
    )
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
    reliability_report["fuzz"]["directory_store_ids"] = {"inputs": inputs["n"], "crashes": 0, "files_outside_root": 0}


@pytest.mark.parametrize("kind", ["directory", "redis"])
def test_every_rolled_back_signed_record_is_refused(kind, tmp_path, redis_proc, reliability_report):
    keys = SnapshotKeys([b"r" * 32])
    store = (
        DirectoryStore(Path(tmp_path) / "s", hmac_keys=keys)
        if kind == "directory"
        else RedisStore(redis_proc.url, prefix=f"rb{os.getpid()}", hmac_keys=keys)
    )
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
    reliability_report["tampering"].append(
        {
            "attack": f"validly signed older record put back ({kind} store)",
            "attempts": n - 1,
            "refused": refused,
            "served": n - 1 - refused,
        }
    )


def test_fuzzed_sampling_fields_never_stop_the_replica(smol_engine, reliability_report):
    """Turns with hypothesis-drawn sampling fields (NaN, infinities, denormals, 1e-40, huge, negative):
    each ends OK or INVALID_ARGUMENT, the engine thread never stops and health stays SERVING."""
    import grpc

    from sidecar._proto.chainkv.v1 import sidecar_pb2_grpc
    from sidecar.grpc.server import ServerOptions, ServerThread
    from tests.sidecar_proc import serving

    srv = ServerThread(smol_engine, ServerOptions(port=0), None)
    port = srv.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    stub = sidecar_pb2_grpc.SidecarStub(channel)
    codes: dict[str, int] = {}
    floats = st.one_of(
        st.floats(0, 2),
        st.floats(allow_nan=True, allow_infinity=True),
        st.sampled_from(
            [float("nan"), float("inf"), -float("inf"), 1e-40, 5e-324, 1e-300, 1e300, -1.0, 0.0, 1e-5, 0.7, 2.0, 100.0]
        ),
    )
    n = {"i": 0}

    @settings(
        max_examples=int(os.environ.get("CHAINKV_FUZZ_EXAMPLES", "0")) or 40,
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.too_slow],
    )
    @given(
        temperature=floats,
        top_p=st.one_of(st.floats(0.05, 1), floats),
        top_k=st.one_of(st.integers(0, 100), st.integers(-(2**31), 2**31 - 1)),
        seed=st.one_of(st.none(), st.integers(-(2**63), 2**63 - 1)),
        stop=st.one_of(
            st.lists(st.text(min_size=1, max_size=8), max_size=2), st.lists(st.text(max_size=300), max_size=20)
        ),
    )
    def check(temperature, top_p, top_k, seed, stop):
        n["i"] += 1
        kw = dict(temperature=temperature, top_p=top_p, top_k=top_k, stop=stop, max_tokens=2)
        if seed is not None:
            kw["seed"] = seed
        req = request(f"fz-{n['i']}", [("user", "Say hi.")], **kw)
        try:
            list(stub.Turn(req))
            code = "OK"
        except grpc.RpcError as e:
            code = e.code().name
        codes[code] = codes.get(code, 0) + 1
        assert code in ("OK", "INVALID_ARGUMENT"), code

    try:
        check()
        assert serving(channel) and srv.server.client.failed is None
    finally:
        channel.close()
        srv.stop(grace=2)
        for sid in list(smol_engine.chains.chains):
            smol_engine.end_session(sid)
    reliability_report["fuzz"]["Turn(sampling fields)"] = {"inputs": n["i"], "crashes": 0, "codes": codes}
