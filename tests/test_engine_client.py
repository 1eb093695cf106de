"""EngineClient, the sidecar's one door to the engine thread, on a tiny random model (fast tier).

Turns stream typed deltas and end in a TurnResult with the session's typed info; an unfinished
turn is rolled back by release_turn; fork, prune (a span, or the rule), snapshot and load go
through it; a failing engine step reaches the stream as EngineFailed; another thread reads the
engine's counters through it; the idle thread wakes to prefetch a session whose agent is due back.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading

import pytest

from engine.chain import SessionHints, SessionNotFound
from engine.prune_rule import PruneRuleError
from engine.sampling import SamplingParams
from engine.api import EngineStats, SessionInfo, TurnSpec
from sidecar.engine_bridge.client import EngineClient, EngineFailed, PruneSpec
from sidecar.engine_bridge.results import TurnResult

from tests.conftest import make_engine

PROMPT = list(range(3, 43))  # 40 tokens
SPANS = [(0, 10, "system"), (10, 30, "tool"), (30, 40, "user")]


@pytest.fixture(scope="module")
def engine(tiny_models):
    path, _ = tiny_models("llama")
    return make_engine(path, device="cpu", num_pages=4000, page_size=4, prefill_chunk_size=64)


def serve(engine, body):
    """Run ``body(client)`` on a fresh event loop with a started client; stop it afterwards."""

    async def main():
        client = EngineClient(engine)
        client.start()
        try:
            return await body(client)
        finally:
            await client.stop()
            for sid in list(engine.chains.chains):
                engine.end_session(sid)

    return asyncio.run(main())


def turn(tokens, max_tokens=4, new=False, spans=None) -> tuple[TurnSpec, bool]:
    """A turn for the client, and whether it starts its session."""
    return TurnSpec(list(tokens), SamplingParams(max_tokens=max_tokens, ignore_eos=True), spans=spans), new


async def finish(client, key, t: tuple[TurnSpec, bool]) -> tuple[list[int], TurnResult]:
    spec, new = t
    stream = await client.start_turn(key, spec, new_session=new)
    ids = [i async for d in stream for i in d.token_ids]
    return ids, stream.result


def test_a_turn_streams_deltas_and_ends_with_its_result_and_the_session(engine):
    async def body(client):
        ids, result = await finish(client, "s", turn(PROMPT, max_tokens=6, new=True, spans=SPANS))
        assert ids == list(result.token_ids) and len(ids) == 6
        assert result.finish_reason == "length" and result.prompt_tokens == 40 and result.source_tier == "new"
        assert result.prefilled_tokens == 40 and result.reused_tokens == 0
        info = result.session
        assert isinstance(info, SessionInfo) and info.session_id == "s"
        assert info.turn_index == 1 and info.num_tokens == 46 and info.last_token == ids[-1]
        assert [(s.start, s.end, s.role) for s in info.spans][:3] == SPANS
        with pytest.raises(dataclasses.FrozenInstanceError):
            info.turn_index = 5
        ids2, second = await finish(client, "s", turn([7, 8, 9]))
        assert second.source_tier == "gpu" and second.reused_tokens >= 45 and second.session.turn_index == 2
        assert await client.session_info("s") == second.session

    serve(engine, body)


def test_release_rolls_an_unfinished_turn_back(engine):
    async def body(client):
        _, first = await finish(client, "r", turn(PROMPT, new=True))
        stream = await client.start_turn("r", *turn([5, 6, 7], max_tokens=500))
        async for _ in stream:
            break  # the turn runs
        info = await client.release_turn("r")
        assert info.turn_index == first.session.turn_index and info.num_tokens == first.session.num_tokens
        assert info.digest == first.session.digest and info.state != "active"
        # a new session whose first turn is released leaves nothing behind
        stream = await client.start_turn("gone", *turn(PROMPT, max_tokens=500, new=True))
        async for _ in stream:
            break
        assert await client.release_turn("gone") is None
        with pytest.raises(SessionNotFound):
            await client.session_info("gone")

    serve(engine, body)


def test_fork_prune_snapshot_load_and_end(engine):
    async def body(client):
        await finish(client, "p", turn(PROMPT, new=True, spans=SPANS))
        await finish(client, "p", turn([9, 9, 9], spans=[(0, 3, "user")]))
        child = await client.fork("p", "p-child")
        assert child.session_id == "p-child" and child.num_tokens == (await client.session_info("p")).num_tokens
        # the rule: spans of the given roles at least ``lag`` turns old (the tool span is from turn 0 of 2)
        assert (await client.prune("p", PruneSpec(roles=("tool",), lag=3))).pruned_tokens == 0
        by_rule = await client.prune("p", PruneSpec(roles=("tool",), lag=2))
        assert by_rule.pruned_tokens == 20 and by_rule.removed > 0
        assert [(r.start, r.end, r.policy, r.reason) for r in by_rule.session.prune_log] == [
            (10, 30, "drop", "request")
        ]
        one = await client.prune("p-child", PruneSpec(span=(0, 10), policy="drop"))
        assert one.pruned_tokens == 10 and one.session.prune_log[-1].policy == "drop"
        for bad in (
            PruneSpec(span=(0, 10_000)),
            PruneSpec(span=(0, 10), scope="sideways"),
            PruneSpec(roles=("tool",), keep_ratio=float("nan")),
            PruneSpec(span=(0, 10), policy="keep_ratio"),
        ):  # this engine records no queries
            with pytest.raises(PruneRuleError):
                await client.prune("p", bad)
        snap = await client.snapshot("p")
        assert await client.end_session("p") and not await client.end_session("p")
        loaded = await client.load(snap)
        assert loaded.session_id == "p" and loaded.num_tokens == by_rule.session.num_tokens
        assert loaded.prune_log == by_rule.session.prune_log

    serve(engine, body)


def test_another_thread_reads_the_counters_through_the_engine_thread(engine):
    async def body(client):
        await finish(client, "c", turn(PROMPT, new=True))
        stats = await asyncio.to_thread(client.stats_blocking)
        assert isinstance(stats, EngineStats) and stats.sessions_by_state == {"idle": 1}
        assert stats.pages_total == 4000 and stats.running == 0
        return client

    client = serve(engine, body)
    assert client.stats_blocking(timeout=1) is None  # stopped: no answer, no wait


def test_an_idle_engine_thread_wakes_to_prefetch_a_session_its_agent_is_due_back_to(engine):
    """Nothing runs and no command comes: the thread sleeps until the session falls due (its expected
    return less ``prefetch_lead_s``, 1 s here) and brings it back onto the GPU by itself."""
    tiers = engine.chains.tiers

    async def body(client):
        spec = TurnSpec(
            list(PROMPT), SamplingParams(max_tokens=4, ignore_eos=True), hints=SessionHints(expected_return_s=2.5)
        )
        stream = await client.start_turn("tool", spec, new_session=True)
        async for _ in stream:
            pass
        before = tiers.prefetches

        def demote() -> str:  # memory pressure while the tool runs
            tiers.demote(engine.chains.chains["tool"])
            return engine.session_info("tool").state

        assert await client._thread.call(demote) == "host"
        for _ in range(600):  # read without a command: a command would wake the thread itself
            if tiers.prefetches > before:
                break
            await asyncio.sleep(0.05)
        assert (await client.session_info("tool")).state == "idle"
        _, again = await finish(client, "tool", turn([5, 6, 7]))
        assert again.source_tier == "gpu"

    serve(engine, body)


def test_a_failing_step_reaches_the_turn_as_engine_failed(tiny_models):
    path, _ = tiny_models("llama")
    engine = make_engine(path, device="cpu", num_pages=1000, page_size=4, prefill_chunk_size=64)
    failures = []

    async def main():
        client = EngineClient(engine, on_failure=failures.append)
        client.start()
        real_step = engine.step
        broke = threading.Event()

        def step():
            if broke.is_set():
                raise RuntimeError("device lost")
            return real_step()

        engine.step = step
        try:
            stream = await client.start_turn("f", *turn(PROMPT, max_tokens=500, new=True))
            async for _ in stream:
                broke.set()
            raise AssertionError("the stream ended without the failure")
        except EngineFailed as e:
            assert "device lost" in str(e)
        await asyncio.sleep(0.05)  # on_failure runs on the loop
        assert isinstance(client.failed, RuntimeError)
        with pytest.raises(EngineFailed):
            client.check_serving()
        with pytest.raises(EngineFailed):
            await client.session_info("f")
        await client.stop()

    asyncio.run(main())
    assert len(failures) == 1 and "device lost" in str(failures[0])
