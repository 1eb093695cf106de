"""Prefetch from the agent's own rhythm (issue 27) on a tiny random model: a session whose turn said
when the agent would be back (``expected_return_s``) and that was demoted to host memory anyway is
brought back onto the GPU shortly before then, into pages no admitted or waiting turn needs, so its
next turn finds it resident; with no spare pages it stays in host memory and no other session is
demoted for it. Time is the tiers' injectable clock, never the wall clock."""

from __future__ import annotations

import pytest

from engine.chain import ChainState, SessionHints
from engine.sampling import SamplingParams

from tests.conftest import SMALL_PAGES_CPU, make_engine, run_turn

GREEDY = SamplingParams(max_tokens=4, ignore_eos=True)
BACK_IN_10S = SessionHints(expected_return_s=10.0)


@pytest.fixture(scope="module")
def tiny(tiny_models):
    return tiny_models("llama")[0]  # 3 layers, 2 kv-heads


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def prompt(i: int, n: int = 40) -> list[int]:
    return [(7 * i + 3 * j) % 300 + 10 for j in range(n)]


def engine_with_clock(tiny, **config):
    eng = make_engine(tiny, SMALL_PAGES_CPU, prefetch_lead_s=2.0, **config)
    clock = Clock()
    eng.chains.tiers.clock = clock
    return eng, clock


def test_a_demoted_session_is_back_on_the_gpu_before_its_agent_returns(tiny):
    eng, clock = engine_with_clock(tiny, num_pages=4000)
    run_turn(eng, "agent", prompt(1), GREEDY, hints=BACK_IN_10S)
    chain = eng.chains.chains["agent"]
    eng.chains.tiers.demote(chain)  # memory pressure moved it off the GPU while its tool runs
    assert chain.state is ChainState.HOST and not eng.manager.has("agent")
    assert eng.next_prefetch_in() == pytest.approx(8.0)  # 10 s after the turn, less the 2 s lead

    clock.now += 7.0  # not due yet: the pages stay free for others
    assert eng.prefetch() == 0 and chain.state is ChainState.HOST
    clock.now += 1.5
    assert eng.prefetch() == 1
    assert chain.state is ChainState.IDLE and eng.manager.has("agent")
    assert eng.next_prefetch_in() is None and eng.prefetch() == 0  # once per announced return

    out = run_turn(eng, "agent", prompt(2, 6), GREEDY)
    assert out.source_tier == "gpu" and out.timing.swap_in_s == 0
    stats = eng.stats()
    assert (stats.prefetches, stats.prefetch_hits) == (1, 1)
    # the prefetched KV is what the session held: the reply is the one it gets never having left the GPU
    ref = make_engine(tiny, SMALL_PAGES_CPU, num_pages=4000)
    run_turn(ref, "agent", prompt(1), GREEDY)
    assert out.token_ids == run_turn(ref, "agent", prompt(2, 6), GREEDY).token_ids


def test_a_running_step_prefetches_into_spare_pages(tiny):
    eng, clock = engine_with_clock(tiny, num_pages=4000)
    run_turn(eng, "agent", prompt(1), GREEDY, hints=BACK_IN_10S)
    chain = eng.chains.chains["agent"]
    eng.chains.tiers.demote(chain)
    clock.now += 9.0
    eng.add_request(prompt(3), GREEDY, request_id="other")  # other work runs meanwhile
    eng.step()
    assert chain.state is ChainState.IDLE and eng.stats().prefetches == 1
    while eng.has_unfinished():
        eng.step()


def test_without_spare_pages_nothing_is_prefetched_and_nobody_is_demoted_for_it(tiny):
    one_session = 3 * 2 * (48 // 4)  # layers x kv-heads x pages of a 44-token history
    eng, clock = engine_with_clock(tiny, num_pages=2 * one_session + 12, max_cached_seqs=64)
    tiers = eng.chains.tiers
    run_turn(eng, "agent", prompt(1), GREEDY, hints=BACK_IN_10S)
    run_turn(eng, "b", prompt(2), GREEDY)
    run_turn(eng, "c", prompt(3), GREEDY)  # needs the pages "agent" held: the least recently used goes
    agent = eng.chains.chains["agent"]
    assert agent.state is ChainState.HOST
    need = tiers.restore_pages(agent.seq, allow_idle=True)
    assert eng.pool.num_free < need  # the pool has no room for it
    demotions = eng.stats().demotions

    clock.now += 9.0  # due
    assert eng.prefetch() == 0
    assert agent.state is ChainState.HOST and eng.manager.has("b") and eng.manager.has("c")
    assert eng.stats().demotions == demotions and eng.stats().prefetches == 0

    eng.end_session("c")  # its pages are free now, but a queued request may need them all
    # a short prompt and a long reply: few pages at first, 6 x 24 / 4 = 36 once its turn is done
    eng.add_request(prompt(4, 4), SamplingParams(max_tokens=20, ignore_eos=True), request_id="queued")
    spare, _ = eng.scheduler.spare_room()
    assert eng.pool.num_free - 36 == spare < need <= eng.pool.num_free - 6  # free pages, not spare ones
    eng.step()
    while eng.has_unfinished():
        assert agent.state is ChainState.HOST  # the request's pages were never the prefetch's
        eng.step()
    # the step that finished the request freed its pages, and its prefetch took them
    assert agent.state is ChainState.IDLE and eng.stats().prefetches == 1
    assert eng.manager.has("b") and eng.stats().demotions == demotions


def test_a_lapsed_pin_then_a_prefetch(tiny):
    """A pin shorter than the tool's run: the session is demoted once the pin lapses, and comes back
    ahead of the return the same turn announced."""
    one_session = 3 * 2 * (48 // 4)
    eng, clock = engine_with_clock(tiny, num_pages=2 * one_session + 12, max_cached_seqs=64)
    hints = SessionHints(pin_ttl_s=3.0, expected_return_s=20.0)
    run_turn(eng, "agent", prompt(1), GREEDY, hints=hints)
    run_turn(eng, "b", prompt(2), GREEDY)
    clock.now += 4.0  # the pin lapsed
    run_turn(eng, "c", prompt(3), GREEDY)
    agent = eng.chains.chains["agent"]
    assert agent.state is ChainState.HOST and eng.manager.has("b")
    eng.end_session("b")
    clock.now += 13.0  # 3 s before the return: not yet within the 2 s lead
    assert eng.prefetch() == 0
    clock.now += 1.5
    assert eng.prefetch() == 1 and agent.state is ChainState.IDLE and eng.manager.has("c")
    assert run_turn(eng, "agent", prompt(4, 6), GREEDY).source_tier == "gpu"


def test_the_earliest_expected_comes_back_first(tiny):
    eng, clock = engine_with_clock(tiny, num_pages=4000)
    for sid, back in (("late", 30.0), ("soon", 5.0)):
        run_turn(eng, sid, prompt(len(sid)), GREEDY, hints=SessionHints(expected_return_s=back))
        eng.chains.tiers.demote(eng.chains.chains[sid])
    clock.now += 40.0  # both due
    assert eng.loop.prefetch(limit=1) == 1
    chains = eng.chains.chains
    assert chains["soon"].state is ChainState.IDLE and chains["late"].state is ChainState.HOST


def test_a_turn_without_the_hint_forgets_the_last_ones(tiny):
    eng, clock = engine_with_clock(tiny, num_pages=4000)
    run_turn(eng, "agent", prompt(1), GREEDY, hints=BACK_IN_10S)
    run_turn(eng, "agent", prompt(2, 6), GREEDY)  # came back early; this turn announces nothing
    eng.chains.tiers.demote(eng.chains.chains["agent"])
    clock.now += 60.0
    assert eng.prefetch() == 0 and eng.next_prefetch_in() is None
    assert eng.stats().prefetch_hits == 0
