"""Scheduling for agent sessions on a tiny random model (issue 27): admission order (a resident
session's turn before a cold one's swap-in, short prefills before long ones), the prefill budget of
steps that decode, agent hints (pins, release, priority) and the per-turn timing record."""

from __future__ import annotations

import math

import pytest

from engine.chain import ChainState, InvalidHint, PinLimit, SessionHints
from engine.sampling import SamplingParams

from tests.conftest import SMALL_PAGES_CPU, make_engine, run_turn

GREEDY = SamplingParams(max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tiny_models):
    return tiny_models("llama")[0]  # 3 layers, 2 kv-heads


@pytest.fixture(scope="module")
def roomy(tiny):
    return make_engine(tiny, SMALL_PAGES_CPU, num_pages=4000, max_pin_ttl_s=600.0)


def prompt(i: int, n: int = 40) -> list[int]:
    return [(7 * i + 3 * j) % 300 + 10 for j in range(n)]


def drain(engine, ids: set) -> dict:
    done = {}
    while len(done) < len(ids):
        for out in engine.step():
            if out.finished and out.request_id in ids:
                done[out.request_id] = out
    return done


# --- admission order ---------------------------------------------------------------------------------


def test_a_resident_turn_is_served_before_a_cold_sessions_swap_in_completes(tiny, monkeypatch):
    def play(engine, demote: bool):
        for sid in ("cold", "warm"):
            run_turn(engine, sid, prompt(len(sid), 40), GREEDY)
        if demote:
            engine.chains.tiers.demote(engine.chains.chains["cold"])
        engine.add_turn("cold", prompt(5, 6), GREEDY)  # queued first: its KV is in host memory
        engine.add_turn("warm", prompt(6, 6), GREEDY)
        return drain(engine, {"cold", "warm"})

    eng = make_engine(tiny, SMALL_PAGES_CPU, num_pages=4000)
    tiers = eng.chains.tiers
    warm_tokens_at_restore = []
    restore = tiers.restore

    def logged_restore(seq):
        warm_tokens_at_restore.append(len(eng.chains.chains["warm"].seq.output_ids))
        restore(seq)

    monkeypatch.setattr(tiers, "restore", logged_restore)
    outs = play(eng, demote=True)
    assert outs["cold"].source_tier == "host" and outs["warm"].source_tier == "gpu"
    # the warm session had its first token when the cold one's KV started coming back
    assert warm_tokens_at_restore and warm_tokens_at_restore[0] >= 1
    assert outs["cold"].timing.swap_in_s > 0 and outs["warm"].timing.swap_in_s == 0
    # and the cold session's reply is what it would have been had it never left the GPU
    ref = play(make_engine(tiny, SMALL_PAGES_CPU, num_pages=4000), demote=False)
    assert outs["cold"].token_ids == ref["cold"].token_ids and outs["warm"].token_ids == ref["warm"].token_ids


def test_a_short_prefill_is_not_stuck_behind_a_long_one(tiny):
    eng = make_engine(tiny, SMALL_PAGES_CPU, num_pages=4000, prefill_chunk_size=32, max_num_batched_tokens=32)
    eng.add_request(prompt(1, 200), GREEDY, request_id="long")
    eng.add_request(prompt(2, 8), GREEDY, request_id="short")
    first_step = {}
    step = 0
    done = set()
    while len(done) < 2:
        step += 1
        for out in eng.step():
            if out.new_token_ids and out.request_id not in first_step:
                first_step[out.request_id] = step
            if out.finished:
                done.add(out.request_id)
    # the long prompt needs 7 steps of 32 tokens; the short one is not queued behind them
    assert first_step["short"] == 1
    assert first_step["long"] > first_step["short"]


def _admission_order(tiny, max_bypass: int) -> list[str]:
    """A long prompt queued first, then one short one arriving every step, two running at a time:
    the order requests were admitted in."""
    eng = make_engine(tiny, SMALL_PAGES_CPU, num_pages=4000, max_num_seqs=2, max_bypass=max_bypass)
    eng.add_request(prompt(1, 64), GREEDY, request_id="long")
    eng.add_request(prompt(9, 8), GREEDY, request_id="short")
    order: list[str] = []
    for i in range(12):
        eng.add_request(prompt(10 + i, 8), GREEDY, request_id=f"short{i}")
        eng.step()
        order += [s.seq_id for s in eng.scheduler.running if s.seq_id not in order]
    while eng.has_unfinished():
        eng.step()
        order += [s.seq_id for s in eng.scheduler.running if s.seq_id not in order]
    return order


def test_an_overtaken_request_goes_first_after_max_bypass(tiny):
    assert _admission_order(tiny, max_bypass=1000).index("long") == 13  # shorter ones first, every time
    assert _admission_order(tiny, max_bypass=2).index("long") <= 4  # two rounds of admissions, then it


def test_prefill_shares_a_decoding_step_up_to_its_budget(tiny, monkeypatch):
    eng = make_engine(tiny, SMALL_PAGES_CPU, num_pages=4000, prefill_tokens_while_decoding=8)
    eng.add_request(prompt(1, 16), SamplingParams(max_tokens=30, ignore_eos=True), request_id="decoding")
    while not eng.stats().decoded_tokens:
        eng.step()
    eng.add_request(prompt(2, 120), GREEDY, request_id="prompt")
    batches = []
    schedule = eng.scheduler.schedule

    def logged():
        b = schedule()
        batches.append((len(b.decode), sum(n for _, n in b.prefill)))
        return b

    monkeypatch.setattr(eng.scheduler, "schedule", logged)
    drain(eng, {"decoding", "prompt"})
    mixed = [p for d, p in batches if d and p]
    assert mixed and max(mixed) <= 8
    assert sum(p for _, p in batches) == 120


# --- agent hints --------------------------------------------------------------------------------------


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _pressure(eng, n: int = 3):
    """Sessions that need the whole pool: idle sessions are demoted to make room."""
    for i in range(n):
        run_turn(eng, f"new{i}", prompt(50 + i, 40), GREEDY)


def test_a_pinned_session_is_not_demoted_while_its_pin_holds(tiny):
    one_session = 3 * 2 * (48 // 4)  # layers x kv-heads x pages of a 44-token history
    eng = make_engine(
        tiny, SMALL_PAGES_CPU, num_pages=2 * one_session + 12, max_pinned_fraction=0.5, max_cached_seqs=64
    )
    clock = Clock()
    eng.chains.tiers.clock = clock
    run_turn(eng, "pinned", prompt(1), GREEDY, hints=SessionHints(pin_ttl_s=30.0))
    run_turn(eng, "other", prompt(2), GREEDY)  # used after "pinned": LRU alone would demote "pinned" first
    _pressure(eng)
    chains = eng.chains.chains
    assert chains["pinned"].state is ChainState.IDLE and eng.manager.has("pinned")
    assert chains["other"].state is not ChainState.IDLE
    assert eng.stats().demotions > 0

    clock.now += 31.0  # the pin lapsed: "pinned" is demoted like any idle session
    _pressure(eng)
    assert chains["pinned"].state is not ChainState.IDLE and not eng.manager.has("pinned")


def test_a_release_ends_the_pin_and_moves_the_session_off_the_gpu(tiny):
    eng = make_engine(tiny, SMALL_PAGES_CPU, num_pages=4000)
    run_turn(eng, "agent", prompt(1), GREEDY, hints=SessionHints(pin_ttl_s=60.0))
    chain = eng.chains.chains["agent"]
    assert chain.pinned(eng.chains.tiers.clock()) and eng.manager.has("agent")
    out = run_turn(eng, "agent", prompt(2, 6), GREEDY, hints=SessionHints(release=True))
    assert out.finish_reason == "length"
    assert not chain.pinned(eng.chains.tiers.clock())
    assert chain.state is ChainState.HOST and not eng.manager.has("agent")
    again = run_turn(eng, "agent", prompt(3, 6), GREEDY)
    assert again.source_tier == "host"


def test_priority_orders_demotion(tiny):
    one_session = 3 * 2 * (48 // 4)
    eng = make_engine(tiny, SMALL_PAGES_CPU, num_pages=2 * one_session + 12, max_cached_seqs=64)
    run_turn(eng, "high", prompt(1), GREEDY, hints=SessionHints(priority=5))
    run_turn(eng, "low", prompt(2), GREEDY, hints=SessionHints(priority=-5))
    run_turn(eng, "new", prompt(3), GREEDY)
    chains = eng.chains.chains
    assert eng.manager.has("high") and not eng.manager.has("low")
    assert chains["high"].priority == 5 and chains["low"].priority == -5


def test_pins_past_the_pools_pin_share_are_refused(tiny):
    eng = make_engine(
        tiny, SMALL_PAGES_CPU, num_pages=400, max_pinned_fraction=0.1
    )  # 40 pages; one 44-token session takes 72
    with pytest.raises(PinLimit, match="at most 40"):
        eng.add_turn("greedy", prompt(1), GREEDY, hints=SessionHints(pin_ttl_s=10.0))
    assert "greedy" not in eng.chains.chains and not eng.has_unfinished()
    run_turn(eng, "fine", prompt(1, 8), GREEDY, hints=SessionHints(pin_ttl_s=10.0))  # 3 pages per head


@pytest.mark.parametrize(
    "hints",
    [
        SessionHints(pin_ttl_s=-1.0),
        SessionHints(pin_ttl_s=0.0),
        SessionHints(pin_ttl_s=math.nan),
        SessionHints(pin_ttl_s=math.inf),
        SessionHints(pin_ttl_s=1e9),
        SessionHints(priority=1000),
        SessionHints(priority=True),
        SessionHints(pin_ttl_s=5.0, release=True),
        SessionHints(expected_return_s=-1.0),
        SessionHints(expected_return_s=0.0),
        SessionHints(expected_return_s=math.nan),
        SessionHints(expected_return_s=math.inf),
        SessionHints(expected_return_s=1e9),
        SessionHints(expected_return_s=True),
        SessionHints(expected_return_s="5"),
        SessionHints(expected_return_s=5.0, release=True),
    ],
)
def test_hostile_hints_are_refused_and_change_nothing(roomy, hints):
    sid = f"s{id(hints)}"
    run_turn(roomy, sid, prompt(1), GREEDY)
    before = roomy.session_info(sid)
    with pytest.raises(InvalidHint):
        roomy.add_turn(sid, prompt(2, 6), GREEDY, hints=hints)
    after = roomy.session_info(sid)
    assert after.turn_index == before.turn_index and after.state == "idle"
    chain = roomy.chains.chains[sid]
    assert chain.pinned_until == 0.0 and chain.expected_at is None and not roomy.has_unfinished()


# --- the timing record -------------------------------------------------------------------------------


def test_each_turn_reports_where_its_time_went(tiny):
    eng = make_engine(tiny, SMALL_PAGES_CPU, num_pages=4000)
    first = run_turn(eng, "s", prompt(1, 80), GREEDY)
    t = first.timing
    assert t is not None and t.prefill_s > 0 and t.decode_s > 0 and t.decode_steps == GREEDY.max_tokens - 1
    assert t.recompute_tokens == 0 and t.swap_in_s == 0
    parts = sum(t.breakdown().values())
    assert parts == pytest.approx(t.total_s, rel=1e-6, abs=1e-6)
    eng.chains.tiers.drop_to_history(eng.chains.chains["s"])  # the next turn re-prefills the history
    again = run_turn(eng, "s", prompt(2, 6), GREEDY)
    assert again.source_tier == "recompute"
    assert again.timing.recompute_tokens == again.turn_start - 1 and again.timing.recompute_s > 0
