"""Idle chains leave the GPU lowest eviction priority first, least recently used within one
(engine/chain/tiers.py ``demotion_order``; set over HTTP by /v1/prefix_cache/set_eviction_priority)."""

from __future__ import annotations

import pytest

from engine.chain import ChainState, SessionNotFound
from engine.sampling import SamplingParams
from tests.conftest import first_turn, make_engine, run_turn


@pytest.fixture(scope="module")
def engine(tiny_chat_dir):
    return make_engine(tiny_chat_dir, num_pages=2000, prefill_chunk_size=128, max_model_len=2048)


def _idle_sessions(engine, names):
    for name in names:
        run_turn(engine, name, first_turn(engine, f"hello from {name}"), SamplingParams(max_tokens=3, ignore_eos=True))
    return [engine.chains.chains[n] for n in names]


def test_a_higher_priority_keeps_an_older_chain_on_the_gpu(engine):
    older, newer = _idle_sessions(engine, ["older", "newer"])
    assert older.last_used < newer.last_used and older.state is newer.state is ChainState.IDLE
    engine.set_eviction_priority("older", 10)
    assert engine.chains.tiers.reclaim_slot()
    assert newer.state is ChainState.HOST and older.state is ChainState.IDLE  # plain LRU would take "older"
    assert engine.chains.tiers.reclaim_slot()
    assert older.state is ChainState.HOST
    for name in ("older", "newer"):
        engine.end_session(name)


def test_equal_priorities_demote_least_recently_used_first(engine):
    a, b = _idle_sessions(engine, ["a", "b"])
    engine.set_eviction_priority("a", -3)
    engine.set_eviction_priority("b", -3)
    assert engine.chains.tiers.reclaim_slot()
    assert a.state is ChainState.HOST and b.state is ChainState.IDLE
    for name in ("a", "b"):
        engine.end_session(name)


def test_span_kv_tokens_and_an_unknown_session(engine):
    (c,) = _idle_sessions(engine, ["c"])
    kept = engine.span_kv_tokens("c")
    assert len(kept) == len(c.spans) and all(0 <= k <= s.end - s.start for k, s in zip(kept, c.spans))
    engine.chains.tiers.demote(c)
    assert engine.span_kv_tokens("c") is None  # its KV is in host RAM
    engine.end_session("c")
    with pytest.raises(SessionNotFound):
        engine.set_eviction_priority("c", 1)
    with pytest.raises(SessionNotFound):
        engine.span_kv_tokens("c")
