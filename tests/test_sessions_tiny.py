"""Session paths of the engine on a tiny random model (the fast tier's counterpart of test_chain.py):
demotion to host memory and back, ending a session mid-turn, forks, snapshots to another engine."""

from __future__ import annotations

import pytest

from engine.cache.snapshot import SessionSnapshot
from engine.chain import SessionBusy, SessionNotFound
from engine.sampling import SamplingParams

from tests.conftest import SMALL_PAGES_CPU, make_engine, run_turn

GREEDY = SamplingParams(max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tiny_models):
    return tiny_models("llama")[0]  # 3 layers, 2 kv-heads


def prompt(i: int, n: int = 40) -> list[int]:
    return [(7 * i + 3 * j) % 300 + 10 for j in range(n)]


def fresh(engine, tokens):
    return engine.generate([tokens], GREEDY)[0].token_ids


def test_sessions_demoted_to_host_come_back_exactly(tiny):
    def play(engine):
        outs = {}
        for turn in range(3):
            for i in range(4):
                outs[(i, turn)] = run_turn(engine, f"s{i}", prompt(10 * turn + i, 40 if turn == 0 else 5), GREEDY)
        return outs

    roomy = play(make_engine(tiny, SMALL_PAGES_CPU, num_pages=4000))
    one_session = 3 * 2 * (60 // 4)  # layers x kv-heads x pages of a session's longest history
    tight = make_engine(tiny, SMALL_PAGES_CPU, num_pages=2 * one_session)
    small = play(tight)
    assert {k: o.token_ids for k, o in small.items()} == {k: o.token_ids for k, o in roomy.items()}
    assert tight.chains.demotions > 0 and any(o.source_tier == "host" for o in small.values())


def test_ending_a_session_mid_turn_aborts_it_and_frees_its_pages(tiny):
    eng = make_engine(tiny, SMALL_PAGES_CPU, num_pages=2000)
    free0 = eng.pool.num_free
    run_turn(eng, "a", prompt(1), GREEDY)
    eng.add_turn("a", prompt(2, 5), SamplingParams(max_tokens=50, ignore_eos=True))
    eng.step()
    with pytest.raises(SessionBusy):
        eng.chains.end("a")  # the chain cache alone never aborts a running turn
    aborted = eng.stats().finished_abort
    eng.end_session("a")  # the engine aborts it first
    assert eng.stats().finished_abort == aborted + 1 and not eng.has_unfinished()
    assert eng.pool.num_free == free0 and "a" not in eng.chains.chains
    with pytest.raises(SessionNotFound):
        eng.session_info("a")


def test_a_fork_continues_like_its_parent(tiny):
    eng = make_engine(tiny, SMALL_PAGES_CPU, num_pages=2000)
    t0 = prompt(3)
    out = run_turn(eng, "p", t0, GREEDY)
    eng.fork_session("p", "c")
    nxt = prompt(4, 5)
    child = run_turn(eng, "c", nxt, GREEDY)
    parent = run_turn(eng, "p", nxt, GREEDY)
    assert child.token_ids == parent.token_ids == fresh(eng, t0 + out.token_ids + nxt)
    assert child.counters.reused_tokens == len(t0) + len(out.token_ids) - 1


def test_a_snapshot_resumes_on_another_engine_or_is_recomputed(tiny):
    eng = make_engine(tiny, SMALL_PAGES_CPU, num_pages=2000)
    t0 = prompt(5)
    out = run_turn(eng, "s", t0, GREEDY)
    blob = eng.snapshot_session("s").to_bytes()
    nxt = prompt(6, 5)
    same = make_engine(tiny, SMALL_PAGES_CPU, num_pages=1000)
    same.load_session(SessionSnapshot.from_bytes(blob))
    other = make_engine(tiny, SMALL_PAGES_CPU, num_pages=1000, page_size=8)  # another fingerprint: the KV is rebuilt
    other.load_session(SessionSnapshot.from_bytes(blob))
    here, there, rebuilt = (run_turn(e, "s", nxt, GREEDY) for e in (eng, same, other))
    assert there.source_tier == "store" and rebuilt.source_tier == "recompute"
    assert here.token_ids == there.token_ids == fresh(eng, t0 + out.token_ids + nxt)
    assert there.counters.prefilled_tokens == len(nxt) + 1
    assert rebuilt.counters.prefilled_tokens == len(t0) + len(out.token_ids) + len(nxt)
