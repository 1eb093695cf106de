"""Fault injection: SIGKILL of a sidecar mid-stream and mid-snapshot, Redis crashed (SIGKILL) while a turn
runs and restarted, the local store's writer killed mid-write. After each, no committed turn is lost and
a resumed session continues with the same greedy tokens as an uninterrupted run.

Two sidecar processes (P1, P2: ``chainkv serve`` on SmolLM2, CPU) share a Redis with an
append-only file (fsync on every write); P1 is restarted once. Both sign their snapshots
(``--snapshot-hmac-key-file``); P2 also serves metrics and logs JSON, which the tests read.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import grpc
import pytest

from sidecar._proto.chainkv.v1 import sidecar_pb2 as pb

from redis_server import RedisProcess
from tests.sidecar_proc import ALPHA, Sidecar, committed, request, run, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.reliability]

TURNS = [
    [("system", "You are a concise assistant."), ("user", "Name three fruits.")],
    [("user", "Which of them is yellow?")],
    [("user", "Thanks. Name one more fruit.")],
]


def stored_turn(redis_proc, session: str) -> int | None:
    v = redis_proc.client().hget(f"chainkv:{{alpha/{session}}}:meta", "turn_index")
    return None if v is None else int(v)


@pytest.fixture(scope="module")
def redis_proc(tmp_path_factory):
    proc = RedisProcess(tmp_path_factory.mktemp("redis-aof"), aof=True).start()
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def hmac_args(tmp_path_factory):
    key = tmp_path_factory.mktemp("hmac") / "key"
    key.write_bytes(os.urandom(16).hex().encode() + b"\n")
    return ["--snapshot-hmac-key-file", str(key)]


@pytest.fixture(scope="module")
def cluster(redis_proc, hmac_args):
    p1 = Sidecar(redis_proc.url, *hmac_args).start()
    p2 = Sidecar(
        redis_proc.url, *hmac_args, "--metrics-port", "0", "--metrics-host", "127.0.0.1", "--log-format", "json"
    ).start()
    procs = {"p1": p1, "p2": p2, "args": hmac_args}
    try:
        p1.wait_ready(), p2.wait_ready()
        ref = [run(p1.stub, request("ref", t)) for t in TURNS]
        yield procs, ref
    finally:
        for name, p in procs.items():
            if name != "args":
                p.stop()


def test_sigkill_mid_stream_then_resume_elsewhere(cluster, redis_proc, reliability_report):
    procs, ref = cluster
    p1, p2 = procs["p1"], procs["p2"]
    done = [run(p1.stub, request("k1", t)) for t in TURNS[:2]]
    assert [d.token_ids for d in done] == [r.token_ids for r in ref[:2]]
    wait_for(lambda: committed(p1.stub, "k1"), what="k1's snapshot")
    stream = p1.stub.Turn(request("k1", TURNS[2], max_tokens=200, ignore_eos=True), metadata=ALPHA)
    got = 0
    for event in stream:  # kill while tokens stream
        got += event.WhichOneof("event") == "delta"
        if got == 3:
            assert p1.kill() == -signal.SIGKILL
            break
    with pytest.raises(grpc.RpcError) as e:
        for _ in stream:
            pass
    assert e.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.UNKNOWN)
    # restarts while P2 carries on; the next test crashes Redis while it may still be starting, so it
    # must not refuse to start then (its health says NOT_SERVING until the store answers)
    procs["p1"] = Sidecar(redis_proc.url, *procs["args"], "--allow-store-down").start()
    assert stored_turn(redis_proc, "k1") == 2  # both committed turns are there; the interrupted one is not
    info = p2.stub.Resume(pb.ResumeRequest(session_id="k1", expected_turn_index=2), metadata=ALPHA)
    assert info.source_tier == pb.TIER_STORE and info.turn_index == 2
    third = run(p2.stub, request("k1", TURNS[2], expected_turn_index=2))
    assert third.token_ids == ref[2].token_ids and third.usage.source_tier == pb.TIER_STORE
    reliability_report["faults"].append(
        {
            "fault": "SIGKILL sidecar mid-stream",
            "count": 1,
            "sessions": 1,
            "sessions_lost": 0,
            "committed_turns_lost": 0,
            "resumed_identical": third.token_ids == ref[2].token_ids,
        }
    )


def test_redis_killed_mid_turn_and_restarted(cluster, redis_proc, reliability_report):
    procs, ref = cluster
    p2 = procs["p2"]
    run(p2.stub, request("k3", TURNS[0]))
    wait_for(lambda: committed(p2.stub, "k3"), what="k3's first snapshot")
    stream = p2.stub.Turn(request("k3", TURNS[1]), metadata=ALPHA)
    events = [next(stream)]
    redis_proc.kill()  # crashes while the turn runs: the turn's snapshot meets a dead store
    events += list(stream)
    second = events[-1].completion
    wait_for(
        lambda: p2.stub.GetSession(pb.GetSessionRequest(session_id="k3"), metadata=ALPHA).snapshot_error,
        what="a failed snapshot attempt",
    )
    redis_proc.start()  # the same port; the append-only file brings back every acknowledged write
    assert stored_turn(redis_proc, "k1") == 3  # written before the crash: kept
    wait_for(lambda: committed(p2.stub, "k3"), timeout=120, what="the snapshot to be written after the restart")
    assert stored_turn(redis_proc, "k3") == 2
    p1 = procs["p1"].wait_ready()
    info = p1.stub.Resume(pb.ResumeRequest(session_id="k3", expected_turn_index=2), metadata=ALPHA)
    assert info.source_tier == pb.TIER_STORE and info.snapshot_error == ""
    third = run(p1.stub, request("k3", TURNS[2], expected_turn_index=2))
    assert second.token_ids == ref[1].token_ids and third.token_ids == ref[2].token_ids
    assert p2.serving() and p1.serving()
    assert redis_proc.client().hget("chainkv:{alpha/k3}:meta", "mac")  # signed
    # P2 counted the failed attempts, logged them as JSON, and recorded the snapshot that landed
    m = p2.metrics()
    assert m[("chainkv_snapshot_failures_total", (("reason", "unavailable"),))] >= 1
    assert m[("chainkv_snapshot_seconds_count", ())] >= 3
    logged = [json.loads(line) for line in p2.output if line.startswith("{")]
    # store failures are logged once a minute by the store's health (sidecar/store/health.py), not per attempt
    assert any(
        r["level"] == "WARNING" and r["logger"] == "sidecar.store.health" and "store is unavailable" in r["msg"]
        for r in logged
    )
    reliability_report["faults"].append(
        {
            "fault": "Redis SIGKILL mid-turn + restart (AOF); the snapshot retried",
            "count": 1,
            "sessions": 2,
            "sessions_lost": 0,
            "committed_turns_lost": 0,
            "resumed_identical": True,
        }
    )


def test_sigkill_mid_snapshot(cluster, redis_proc, reliability_report):
    """Redis is paused (DEBUG SLEEP) while P2 writes the snapshot of a finished turn; P2 is killed
    with the write in flight. The store keeps the previous committed turn, consistent; the
    uncommitted turn is run again on P1 and gives the same tokens."""
    procs, ref = cluster
    p1, p2 = procs["p1"].wait_ready(), procs["p2"]
    run(p2.stub, request("k2", TURNS[0]))
    wait_for(lambda: committed(p2.stub, "k2"), what="k2's first snapshot")
    paused: list = []
    pause = threading.Thread(target=lambda: paused.append(redis_proc.client().execute_command("DEBUG", "SLEEP", "3")))
    stream = p2.stub.Turn(request("k2", TURNS[1]), metadata=ALPHA)
    events = [next(stream)]
    pause.start()
    time.sleep(0.2)  # Redis is asleep: the snapshot that follows the turn blocks in the store
    events += list(stream)
    uncommitted = events[-1].completion
    time.sleep(0.5)
    assert p2.kill() == -signal.SIGKILL  # mid-write
    pause.join()
    assert paused == [b"OK"]  # Redis really was asleep through the write
    at = stored_turn(redis_proc, "k2")
    assert at in (1, 2)  # the last committed turn, whole
    if at == 1:  # the store is behind the turn the client saw: a resume at turn 2 is refused, not faked
        with pytest.raises(grpc.RpcError) as e:
            p1.stub.Resume(pb.ResumeRequest(session_id="k2", expected_turn_index=2), metadata=ALPHA, timeout=30)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    info = p1.stub.Resume(pb.ResumeRequest(session_id="k2", expected_turn_index=at), metadata=ALPHA)
    assert info.source_tier == pb.TIER_STORE and info.snapshot_error == ""
    if at == 1:  # the client's retry of the uncommitted turn
        again = run(p1.stub, request("k2", TURNS[1], expected_turn_index=1))
        assert again.token_ids == uncommitted.token_ids == ref[1].token_ids
    third = run(p1.stub, request("k2", TURNS[2], expected_turn_index=2))
    assert third.token_ids == ref[2].token_ids
    reliability_report["faults"].append(
        {
            "fault": "SIGKILL sidecar mid-snapshot (Redis paused mid-write)",
            "count": 1,
            "sessions": 1,
            "sessions_lost": 0,
            "committed_turns_lost": 0,
            "store_turn_after_kill": at,
            "resumed_identical": True,
        }
    )


WRITER = textwrap.dedent("""
    import os, sys
    from sidecar.store import DirectoryStore, StoredSession
    store = DirectoryStore(sys.argv[1], chunk_bytes=65536)
    gen = None
    i = 0
    while True:
        i += 1
        blob = bytes([i % 251]) * (300_000 + 1000 * (i % 7))
        rec = {"session_id": "s", "generation": i, "turn_index": i, "tokens": i.to_bytes(4, "little"),
               "digest": str(i), "fingerprint": "m"}
        store.save("s", StoredSession(record=rec, app={}, kv=blob), gen)
        gen = i
        print(i, flush=True)
""")


def test_local_store_writer_killed_mid_write(tmp_path, reliability_report):
    """A process rewriting a session in a DirectoryStore as fast as it can is SIGKILLed at
    varying moments, 12 times: the store always holds one whole committed generation, at least
    the last one the writer reported, whose KV verifies, and the next writer continues from it."""
    from sidecar.store import DirectoryStore

    root = tmp_path / "sessions"
    env = dict(os.environ, PYTHONPATH=str(__import__("pathlib").Path(__file__).resolve().parents[2]))
    last_seen = 0
    kills = 12
    store = DirectoryStore(root)
    for k in range(kills):
        if k:  # continue from what is committed
            stored = store.load("s")
            script = WRITER.replace("gen = None\n    i = 0", f"gen = {stored.generation}\n    i = {stored.generation}")
        else:
            script = WRITER
        proc = subprocess.Popen([sys.executable, "-c", script, str(root)], stdout=subprocess.PIPE, text=True, env=env)
        target = 2 + (k * 5) % 9  # kill after a varying number of commits, mid-way through the next
        reported = 0
        for line in proc.stdout:
            reported = int(line)
            if reported >= last_seen + target:
                break
        time.sleep(0.003 * (k % 4))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        got = store.load("s")
        assert got is not None and got.kv_error is None, got and got.kv_error
        assert got.generation >= reported  # nothing reported as committed is lost
        assert got.kv == bytes([got.generation % 251]) * (300_000 + 1000 * (got.generation % 7))
        assert got.record["tokens"] == got.generation.to_bytes(4, "little")
        last_seen = got.generation
    leftovers = [p.name for p in store.folder("s").iterdir() if p.name.endswith(".tmp")]
    reliability_report["faults"].append(
        {
            "fault": "SIGKILL of a local-store writer mid-write",
            "count": kills,
            "sessions": 1,
            "sessions_lost": 0,
            "committed_turns_lost": 0,
            "temp_files_left": len(leftovers),
        }
    )
