"""The gRPC sidecar against a real redis-server: resume on another replica after SIGKILL, a corrupt
KV chunk rebuilt by recompute, per-session ordering and request_id replay, cancellation and
deadlines stopping the engine, Redis outages, bad requests, auth and tenants, graceful shutdown.

Two sidecar processes (A, B: ``chainkv serve`` on SmolLM2, CPU) share one Redis with an
in-process sidecar (C, on the shared ``smol_engine``, so its engine counters can be read).
Turns are greedy and short.
"""

from __future__ import annotations

import asyncio
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from sidecar._proto.chainkv.v1 import sidecar_pb2 as pb
from sidecar._proto.chainkv.v1 import sidecar_pb2_grpc
from sidecar.grpc.errors import TURN_INDEX_CONFLICT_KEY
from sidecar.turns.request import from_proto

from tests.sidecar_proc import ALPHA, BETA, TOKENS, Sidecar, committed, request, run, serving, turn_events, wait_for

pytestmark = pytest.mark.slow

TURNS = [
    [("system", "You are a concise assistant."), ("user", "Name three fruits.")],
    [("user", "Which of them is yellow?")],
    [("tool", "Weather report: sunny, 21 C in Paris.")],
    [("user", "Thanks. Name one more fruit.")],
]
C = grpc.StatusCode


def fresh(stub, session: str) -> None:
    """End ``session`` (here and in the store) if it exists: the test starts it anew (and can be repeated)."""
    try:
        stub.EndSession(pb.EndSessionRequest(session_id=session), metadata=ALPHA)
    except grpc.RpcError as e:
        assert e.code() == C.NOT_FOUND, e.details()


@pytest.fixture(scope="module")
def replicas(redis_proc):
    """Sidecars A and B (processes), started together."""
    a, b = Sidecar(redis_proc.url, grace_s=10).start(), Sidecar(redis_proc.url, grace_s=10).start()
    try:
        yield a.wait_ready(), b.wait_ready()
    finally:
        for p in (a, b):
            p.stop()


@pytest.fixture(scope="module")
def local(smol_engine, redis_proc):
    """Sidecar C in this process (so the tests can read its engine's counters)."""
    from sidecar.grpc.auth import Authenticator
    from sidecar.grpc.server import ServerOptions, ServerThread
    from sidecar.store import RedisStore

    options = ServerOptions(
        port=0, auth=Authenticator(TOKENS), snapshot_retry_max_s=0.5, resume_wait_s=1.0, max_message_bytes=1 << 20
    )
    server = ServerThread(smol_engine, options, RedisStore(redis_proc.url))
    port = server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    yield server, sidecar_pb2_grpc.SidecarStub(channel), channel
    channel.close()
    server.stop(grace=2)
    for sid in list(smol_engine.chains.chains):
        smol_engine.end_session(sid)


@pytest.fixture(scope="module")
def on_a(replicas):
    """On A: an uninterrupted 4-turn session (the reference), the same conversation stopped after
    3 turns, and again after 2; once both snapshots are committed, A is SIGKILLed."""
    a, _ = replicas
    ref = [run(a.stub, request("ref", t)) for t in TURNS]
    s1 = [run(a.stub, request("s1", t)) for t in TURNS[:3]]
    c = [run(a.stub, request("c", t)) for t in TURNS[:2]]
    wait_for(lambda: all(committed(a.stub, sid) for sid in ("ref", "s1", "c")), what="A's snapshots")
    assert a.signal(signal.SIGKILL) == -signal.SIGKILL
    return ref, s1, c


def test_resume_on_another_replica_after_sigkill(replicas, on_a):
    _, b = replicas
    ref, s1, _ = on_a
    assert [x.token_ids for x in s1] == [x.token_ids for x in ref[:3]]
    assert [x.usage.source_tier for x in ref] == [pb.TIER_NEW] + [pb.TIER_GPU] * 3
    info = b.stub.Resume(pb.ResumeRequest(session_id="s1", expected_turn_index=3), metadata=ALPHA)
    assert info.source_tier == pb.TIER_STORE and info.turn_index == 3 and info.snapshot_error == ""
    assert info.history_tokens == ref[2].usage.history_tokens
    fourth = run(b.stub, request("s1", TURNS[3], expected_turn_index=3))
    assert fourth.token_ids == ref[3].token_ids  # the same greedy tokens as the uninterrupted run
    assert fourth.usage.source_tier == pb.TIER_STORE
    assert fourth.usage.prefilled_tokens == ref[3].usage.prefilled_tokens  # only the new tokens were prefilled
    # another tenant does not see the session
    with pytest.raises(grpc.RpcError) as e:
        b.stub.GetSession(pb.GetSessionRequest(session_id="s1"), metadata=BETA)
    assert e.value.code() == C.NOT_FOUND


def test_corrupt_kv_chunk_is_detected_and_rebuilt_by_recompute(replicas, on_a, redis_proc):
    _, b = replicas
    ref, _, c = on_a
    r = redis_proc.client()
    chunks = sorted(r.scan_iter("chainkv:{alpha/c}:kv:*"))
    assert chunks, "the session's KV chunks are in Redis"
    byte = r.getrange(chunks[0], 4096, 4096)
    r.setrange(chunks[0], 4096, bytes([byte[0] ^ 0xFF]))
    info = b.stub.Resume(pb.ResumeRequest(session_id="c"), metadata=ALPHA)
    assert info.source_tier == pb.TIER_RECOMPUTE and "checksum" in info.snapshot_error
    assert info.turn_index == 2 and info.state == pb.SESSION_STATE_HISTORY
    third = run(b.stub, request("c", TURNS[2]))
    assert third.usage.source_tier == pb.TIER_RECOMPUTE
    # the whole history was prefilled again
    assert third.usage.reused_tokens == 0
    assert third.usage.prefilled_tokens == third.usage.history_tokens - third.usage.generated_tokens
    assert third.token_ids == ref[2].token_ids
    # KV made by another model (fingerprint) is never loaded: the session is rebuilt
    r.hset("chainkv:{alpha/ref}:meta", "fingerprint", "other-model|LlamaForCausalLM|1x1x1|torch.float32|p16")
    info = b.stub.Resume(pb.ResumeRequest(session_id="ref"), metadata=ALPHA)
    assert info.source_tier == pb.TIER_RECOMPUTE and "made by 'other-model" in info.snapshot_error


def test_second_turn_is_aborted_and_a_retry_replays_without_running_again(local):
    server, stub, _ = local
    eng = server.server.engine
    first_req = request("busy", TURNS[0], "r1", max_tokens=40, ignore_eos=True)
    stream = iter(stub.Turn(first_req, metadata=ALPHA))
    head = [next(stream)]  # the turn is running
    with ThreadPoolExecutor(1) as pool:
        early_retry = pool.submit(lambda: turn_events(stub, first_req))  # arrives while the first attempt runs
        with pytest.raises(grpc.RpcError) as e:  # waits for the running turn, which finishes: refused
            run(stub, request("busy", TURNS[1], "r2"))
        assert e.value.code() == C.ABORTED
        events = head + list(stream)
        first = events[-1].completion
        decoded = eng.totals["decoded_tokens"]
        waited_events, waited = early_retry.result(120)
    late_events, late = turn_events(stub, first_req)
    assert not first.replayed and waited.replayed and late.replayed
    assert len(first.token_ids) == 40
    assert waited.token_ids == late.token_ids == first.token_ids and waited.text == late.text == first.text
    assert waited.usage == first.usage and late.turn_index == first.turn_index == 0
    text = "".join(ev.delta.text for ev in events if ev.WhichOneof("event") == "delta")
    assert "".join(ev.delta.text for ev in late_events if ev.WhichOneof("event") == "delta") == text
    assert eng.totals["decoded_tokens"] == decoded  # the engine ran the turn once
    assert stub.GetSession(pb.GetSessionRequest(session_id="busy"), metadata=ALPHA).turn_index == 1


def test_cancel_and_deadline_stop_the_engine_and_roll_the_turn_back(local):
    server, stub, _ = local
    eng = server.server.engine
    run(stub, request("cancel", TURNS[0], max_tokens=4))
    before = stub.GetSession(pb.GetSessionRequest(session_id="cancel"), metadata=ALPHA)
    totals = dict(eng.totals)

    def settled():
        s = stub.GetSession(pb.GetSessionRequest(session_id="cancel"), metadata=ALPHA)
        return s if s.state != pb.SESSION_STATE_ACTIVE and eng.stats().running == 0 else None

    call = stub.Turn(request("cancel", TURNS[1], max_tokens=300, ignore_eos=True), metadata=ALPHA)
    for n, _ in enumerate(call, 1):
        if n == 3:
            call.cancel()
            break
    after = wait_for(settled, what="the cancelled turn to be aborted")
    decoded = eng.totals["decoded_tokens"]
    time.sleep(0.5)
    assert eng.totals["decoded_tokens"] == decoded  # decoding stopped
    assert eng.totals["finished_abort"] == totals["finished_abort"] + 1
    assert decoded - totals["decoded_tokens"] < 300
    assert after.turn_index == before.turn_index and after.digest == before.digest  # rolled back

    with pytest.raises(grpc.RpcError) as e:
        run(stub, request("cancel", TURNS[1], max_tokens=300, ignore_eos=True), timeout=1.5)
    assert e.value.code() == C.DEADLINE_EXCEEDED
    after = wait_for(settled, what="the expired turn to be aborted")
    assert eng.totals["finished_abort"] == totals["finished_abort"] + 2
    assert after.turn_index == before.turn_index and after.digest == before.digest
    ok = run(stub, request("cancel", TURNS[1]))  # the session carries on
    assert ok.turn_index == 1 and ok.usage.source_tier == pb.TIER_GPU


def test_a_turn_sent_right_after_a_rejected_or_cancelled_one_is_not_refused_as_busy(local, smol_engine):
    """A turn rejected after it took its session releases the session before its error is sent; a
    cancelled one is rolled back before the next turn takes the session. Either way the next Turn,
    sent at once, runs (before: ABORTED, "a turn is already running", 1-4 times in 5)."""
    _, stub, _ = local
    fresh(stub, "again")
    run(stub, request("again", TURNS[0], max_tokens=2))
    tools = [pb.Tool(name="lookup", description="Look a word up.", parameters_json='{"type": "object"}')]
    too_long = [("user", "fruit " * (smol_engine.max_model_len + 10))]
    turn_index = 1
    for i in range(50):
        if i % 10 == 9:  # refused by the engine (ContextFull), on the engine thread
            bad, code = request("again", too_long), C.INVALID_ARGUMENT
        else:  # refused by the sidecar once the session is taken: a session's tools are fixed
            bad, code = request("again", TURNS[1], tools=tools), C.FAILED_PRECONDITION
        with pytest.raises(grpc.RpcError) as e:
            run(stub, bad)
        assert e.value.code() == code, f"rejection {i}: {e.value.code()} {e.value.details()}"
        ok = run(stub, request("again", [("user", f"Say {i}.")], max_tokens=1))
        assert ok.turn_index == turn_index
        turn_index += 1
    for i in range(5):
        call = stub.Turn(request("again", TURNS[3], max_tokens=200, ignore_eos=True), metadata=ALPHA)
        next(call)  # the turn runs
        call.cancel()
        ok = run(stub, request("again", [("user", f"Then say {i}.")], max_tokens=1))
        assert ok.turn_index == turn_index  # the cancelled turn was rolled back, this one ran
        turn_index += 1


def test_a_turn_that_arrives_before_the_cancel_of_the_running_one_waits_for_its_rollback(local):
    """A client cancels a turn and sends the next at once; gRPC may hand the server that next Turn
    before the cancel (before: ABORTED "a turn is already running", about 1 run in 200 under load).
    Driven on the server's loop with the cancel seen late every time: the next turn, meeting the
    session still held, waits for the running turn and runs once it is rolled back."""
    server, stub, _ = local
    turns = server.server.turns
    fresh(stub, "late")
    run(stub, request("late", TURNS[0], max_tokens=2))

    async def completion(turn) -> pb.TurnCompletion:
        return [event async for event in turn][-1].completion

    async def next_turn_then_cancel(i: int) -> pb.TurnCompletion:
        first = turns.run("alpha", from_proto(request("late", TURNS[3], max_tokens=200, ignore_eos=True)), None)
        await anext(first)  # the turn runs
        nxt = asyncio.ensure_future(
            completion(turns.run("alpha", from_proto(request("late", [("user", f"Say {i}.")])), None))
        )
        for _ in range(i % 3 + 1):
            await asyncio.sleep(0)  # the next turn meets the session held
        await first.aclose()  # only now is the first one's caller seen gone
        return await nxt

    for i in range(20):
        assert server.run(next_turn_then_cancel(i)).turn_index == i + 1


def test_many_turns_sent_right_after_a_rejected_cancelled_or_expired_one_all_run(local, smol_engine):
    """The stress version: 60 rounds of a turn refused (tools changed, prompt too long), cancelled
    after 0-3 events, or past its deadline, each followed at once by the next turn, on the same or
    another channel (another connection: nothing orders the cancel before it). Every next turn runs."""
    server, stub, _ = local
    other = grpc.insecure_channel(f"127.0.0.1:{server.server.port}")
    stubs = [stub, sidecar_pb2_grpc.SidecarStub(other)]
    tools = [pb.Tool(name="lookup", description="Look a word up.", parameters_json='{"type": "object"}')]
    too_long = [("user", "fruit " * (smol_engine.max_model_len + 10))]
    long_turn = request("stress", TURNS[3], max_tokens=300, ignore_eos=True)
    fresh(stub, "stress")
    run(stub, request("stress", TURNS[0], max_tokens=2))
    turn_index = 1
    try:
        for i in range(60):
            kind = i % 6
            if kind < 2:
                bad = request("stress", TURNS[1], tools=tools) if kind == 0 else request("stress", too_long)
                with pytest.raises(grpc.RpcError) as e:
                    run(stub, bad)
                assert e.value.code() == (C.FAILED_PRECONDITION, C.INVALID_ARGUMENT)[kind], e.value.details()
            elif kind < 5:
                call = stub.Turn(long_turn, metadata=ALPHA)
                for _ in range((i // 6) % 4):
                    next(call)
                call.cancel()
            else:
                with pytest.raises(grpc.RpcError) as e:
                    run(stub, long_turn, timeout=0.5)
                assert e.value.code() == C.DEADLINE_EXCEEDED
            ok = run(stubs[i % 2], request("stress", [("user", f"Say {i}.")], max_tokens=1))
            assert ok.turn_index == turn_index, f"round {i}"
            turn_index += 1
    finally:
        other.close()


def test_bad_requests_get_their_status_and_the_server_keeps_serving(local, smol_engine):
    server, stub, channel = local
    user = TURNS[1]
    raw = request("utf8", [("user", "ZZZZ")]).SerializeToString().replace(b"ZZZZ", b"\xff\xfe\xfd\xfc")
    raw_turn = channel.unary_stream(
        "/chainkv.v1.Sidecar/Turn", request_serializer=lambda b: b, response_deserializer=pb.TurnEvent.FromString
    )
    too_long = [("user", "fruit " * (smol_engine.max_model_len + 10))]
    cases = [
        (lambda: run(stub, request("", user)), C.INVALID_ARGUMENT),
        (lambda: run(stub, request("x" * 129, user)), C.INVALID_ARGUMENT),
        (lambda: run(stub, request("bad{id}", user)), C.INVALID_ARGUMENT),
        (lambda: run(stub, request("m", user, method="no_such_method")), C.INVALID_ARGUMENT),
        (lambda: run(stub, request("long", too_long)), C.INVALID_ARGUMENT),
        (lambda: list(raw_turn(raw, metadata=ALPHA)), C.INVALID_ARGUMENT),
        (lambda: run(stub, request("neg", user, max_tokens=-1)), C.INVALID_ARGUMENT),
        (lambda: run(stub, request("role", [("wizard", "hi")])), C.INVALID_ARGUMENT),
        (lambda: stub.Resume(pb.ResumeRequest(session_id="never-seen"), metadata=ALPHA), C.NOT_FOUND),
        (lambda: run(stub, request("big", [("user", "x" * (2 << 20))])), C.RESOURCE_EXHAUSTED),
        (lambda: run(stub, request("anon", user), metadata=None), C.UNAUTHENTICATED),
        (lambda: run(stub, request("anon", user), metadata=[("authorization", "Bearer nope")]), C.UNAUTHENTICATED),
    ]
    for i, (call, code) in enumerate(cases):
        with pytest.raises(grpc.RpcError) as e:
            call()
        assert e.value.code() == code, f"case {i}: {e.value.code()} {e.value.details()}"
        assert serving(channel)
    # optimistic concurrency: a client behind the session, a client ahead of every copy of it
    run(stub, request("occ", TURNS[0]))
    with pytest.raises(grpc.RpcError) as e:
        run(stub, request("occ", TURNS[1], expected_turn_index=0))
    assert e.value.code() == C.FAILED_PRECONDITION
    wait_for(lambda: committed(stub, "occ"), what="the snapshot")
    with pytest.raises(grpc.RpcError) as e:  # no copy reached turn 5 within resume_wait_s: refused, never run at 1
        run(stub, request("occ", TURNS[1], expected_turn_index=5))
    assert e.value.code() == C.FAILED_PRECONDITION and "is at turn 1, not 5: turns were lost" in e.value.details()
    trailer = dict(e.value.trailing_metadata())[TURN_INDEX_CONFLICT_KEY]
    assert pb.TurnIndexConflict.FromString(trailer) == pb.TurnIndexConflict(session_turn_index=1, expected_turn_index=5)
    with pytest.raises(grpc.RpcError) as e:  # a session no copy holds (a store that lost everything): at turn 0
        run(stub, request("occ-gone", TURNS[1], expected_turn_index=2))
    assert e.value.code() == C.FAILED_PRECONDITION
    trailer = dict(e.value.trailing_metadata())[TURN_INDEX_CONFLICT_KEY]
    assert pb.TurnIndexConflict.FromString(trailer).session_turn_index == 0
    with pytest.raises(grpc.RpcError) as e:  # nothing was created under it
        stub.GetSession(pb.GetSessionRequest(session_id="occ-gone"), metadata=ALPHA)
    assert e.value.code() == C.NOT_FOUND
    child = stub.ForkSession(pb.ForkSessionRequest(session_id="occ", new_session_id="occ-child"), metadata=ALPHA)
    assert child.turn_index == 1
    with pytest.raises(grpc.RpcError) as e:
        stub.ForkSession(pb.ForkSessionRequest(session_id="occ", new_session_id="occ-child"), metadata=ALPHA)
    assert e.value.code() == C.ALREADY_EXISTS
    a = run(stub, request("occ", TURNS[1], expected_turn_index=1))
    b = run(stub, request("occ-child", TURNS[1], expected_turn_index=1))
    assert a.token_ids == b.token_ids
    run(stub, request("occ", TURNS[2]))
    pruned = stub.PruneHistory(pb.PruneHistoryRequest(session_id="occ", prune_roles=["tool"]), metadata=ALPHA)
    assert pruned.pruned_tokens > 0 and pruned.removed > 0 and pruned.session.prune_log[-1].prune_policy == "drop"
    # the same session id under another tenant is another session
    other = run(stub, request("occ", TURNS[0]), metadata=BETA)
    assert other.turn_index == 0
    ended = stub.EndSession(pb.EndSessionRequest(session_id="occ-child"), metadata=ALPHA)
    assert ended.ended_here
    with pytest.raises(grpc.RpcError) as e:
        stub.GetSession(pb.GetSessionRequest(session_id="occ-child"), metadata=ALPHA)
    assert e.value.code() == C.NOT_FOUND
    assert serving(channel)


def test_demo_runs_a_session_against_the_sidecar(local):
    import io

    from sidecar.cli.demo import calculate, run_demo

    server, _, _ = local
    assert calculate("37 * (40 + 1)") == "1517" and calculate("__import__('os')").startswith("error")
    out = io.StringIO()
    assert run_demo(f"127.0.0.1:{server.server.port}", "demo", max_tokens=12, token="tok-alpha", out=out) == 0
    text = out.getvalue()
    assert text.count("[turn ") >= 3 and "a new session" in text and "KV in device memory" in text
    assert "-> tool call: calculator(" in text and "2 tool round trip(s)" in text  # forced: real round trips
    assert "KV from the session store" not in text and "cache reuse: " in text
    assert "session: " in text and server.server.sessions.local("alpha/demo") is None  # ended


def test_redis_down_turns_still_run_snapshot_pending_then_written(local, replicas, redis_proc):
    server, stub, channel = local
    _, b = replicas
    run(stub, request("down", TURNS[0]))
    wait_for(lambda: committed(stub, "down"), what="the first snapshot")
    redis_proc.stop()
    try:
        second = run(stub, request("down", TURNS[1]))
        assert second.usage.source_tier == pb.TIER_GPU  # served from the accelerator
        info = wait_for(
            lambda: (
                (s := stub.GetSession(pb.GetSessionRequest(session_id="down"), metadata=ALPHA)).snapshot_error and s
            ),
            what="the failed snapshot attempt",
        )
        assert info.snapshot_state == pb.SNAPSHOT_STATE_PENDING and info.committed_generation < info.generation
        with pytest.raises(grpc.RpcError) as e:
            b.stub.Resume(pb.ResumeRequest(session_id="down"), metadata=ALPHA)
        assert e.value.code() == C.UNAVAILABLE
        wait_for(lambda: not serving(channel), what="health NOT_SERVING while the store is down (issue 30)")
    finally:
        redis_proc.start()
    wait_for(lambda: committed(stub, "down"), what="the pending snapshot to be written")
    assert serving(channel)  # the store answered the snapshot
    meta = redis_proc.client().hgetall("chainkv:{alpha/down}:meta")
    assert int(meta[b"turn_index"]) == 2
    # B now resumes the session at turn 2; after its turn, SIGTERM drains and flushes before exiting
    info = b.stub.Resume(pb.ResumeRequest(session_id="down", expected_turn_index=2), metadata=ALPHA)
    assert info.source_tier == pb.TIER_STORE
    third = run(b.stub, request("down", TURNS[2]))
    assert b.signal(signal.SIGTERM) == 0
    meta = redis_proc.client().hgetall("chainkv:{alpha/down}:meta")
    assert int(meta[b"turn_index"]) == 3 and int(meta[b"generation"]) == third.generation
