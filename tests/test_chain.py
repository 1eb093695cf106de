"""The Chain Cache on SmolLM2: multi-turn reuse, pruning, shared prefixes, tiers, fork, snapshots."""

from __future__ import annotations

import math

import pytest
import torch

from engine.cache.snapshot import SessionSnapshot, SnapshotError
from engine.chain import HistoryMismatch, SessionBusy, SessionNotFound, TurnIndexMismatch
from engine.method_spec import MethodSpec
from engine.sampling import SamplingParams

from tests.conftest import first_turn, haystack, make_engine, next_turn, run_turn

L, H, P = 30, 3, 16
GREEDY = SamplingParams(max_tokens=6)
USER_TURNS = [
    "Hi! Who are you?",
    "What is 2 + 2?",
    "Name a color.",
    "Tell me a fun fact about cats.",
    "And one about dogs?",
    "Thanks, bye!",
]


def fresh(engine, prompt, params=GREEDY):
    return engine.generate([prompt], params)[0].token_ids


def test_six_turns_equal_rerunning_the_transcript(smol_engine):
    eng = smol_engine
    used0 = eng.pool.num_used
    history: list[int] = []
    for i, text in enumerate(USER_TURNS):
        new = first_turn(eng, text) if i == 0 else next_turn(eng, text)
        out = run_turn(eng, "six", new, GREEDY)
        assert out.token_ids == fresh(eng, history + new), f"turn {i} differs from a from-scratch run"
        if i == 0:
            assert out.counters.prefilled_tokens == len(new) and out.source_tier == "new"
        else:
            # only the new tokens (and the previous reply's last token, whose KV a reply never computes)
            assert out.counters.prefilled_tokens == len(new) + 1
            assert out.counters.reused_tokens == len(history) - 1
            assert out.source_tier == "gpu"
        history += new + out.token_ids
        assert eng.session_info("six").num_tokens == len(history)
    assert eng.session_info("six").turn_index == 6
    eng.end_session("six")
    with pytest.raises(SessionNotFound):
        eng.session_info("six")
    assert eng.pool.num_used == used0


@pytest.mark.parametrize("method", ["streaming_llm", "snapkv"])
def test_eviction_method_reuses_compressed_kv(smol_engine, method):
    eng = smol_engine
    spec = MethodSpec(method, budget=96, method_args={"slack": 0} if method == "streaming_llm" else {})
    # streaming_llm evicts while decoding too; snapkv compresses each turn's input, then appends its reply
    bound = 96 if method == "streaming_llm" else 96 + GREEDY.max_tokens

    def session(sid):
        outs = [run_turn(eng, sid, first_turn(eng, haystack(12) + " Which item is red?"), GREEDY, method=spec)]
        for text in ("And which is blue?", "Thanks."):
            assert int(eng.manager.seq_lengths(sid).max()) <= bound  # compressed between turns
            outs.append(run_turn(eng, sid, next_turn(eng, text), GREEDY))
        return outs

    a, b = session(f"{method}-a"), session(f"{method}-b")
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    for prev, out in zip(a, a[1:]):
        assert out.counters.reused_tokens == out.turn_start - 1
        assert out.counters.prefilled_tokens == len(out.prompt_token_ids) - out.turn_start + 1
    for sid in (f"{method}-a", f"{method}-b"):
        eng.end_session(sid)


def test_pruning_a_tool_span_frees_pages_and_keeps_the_prefix(smol_engine):
    eng = smol_engine
    run_turn(eng, "prune", first_turn(eng, "Look up the weather, please."), GREEDY)
    tool = next_turn(eng, "Weather report: " + haystack(20), role="tool")
    out = run_turn(eng, "prune", tool, GREEDY, role="tool")
    info = eng.session_info("prune")
    span = (out.turn_start, out.turn_start + len(tool))
    pages_before = eng.manager.num_pages("prune")
    removed = eng.prune_history("prune", *span, policy="drop")
    after = eng.session_info("prune")
    assert removed == L * H * len(tool)
    assert after.digest == info.digest and after.num_tokens == info.num_tokens
    # the span held ceil(len/16)-ish pages per head; compaction gives back what it no longer needs
    held = eng.manager.seq_lengths("prune")
    assert int(held.min()) == int(held.max()) == info.num_tokens - 1 - len(tool)
    assert eng.manager.num_pages("prune") == L * H * math.ceil(int(held[0, 0]) / P) < pages_before
    assert after.prune_log[-1].removed == removed
    nxt = next_turn(eng, "So, should I take an umbrella?")
    out2 = run_turn(eng, "prune", nxt, GREEDY)
    assert out2.counters.prefilled_tokens == len(nxt) + 1 and out2.source_tier == "gpu"
    eng.end_session("prune")


@pytest.mark.slow
def test_keep_ratio_pruning_keeps_the_attended_part():
    eng = make_engine(
        None,
        num_pages=20000,
        prefill_chunk_size=256,
        prune_policy="keep_ratio",
        prune_keep_ratio=0.5,
        prune_roles=["tool"],
        prune_lag=0,
    )
    run_turn(eng, "kr", first_turn(eng, "Check the inventory."), GREEDY)
    tool = next_turn(eng, "Inventory: " + haystack(10), role="tool")
    out = run_turn(eng, "kr", tool, GREEDY, role="tool")  # prune_lag 0: pruned at the end of its own turn
    log = eng.session_info("kr").prune_log
    assert len(log) == 1 and log[0].policy == "keep_ratio" and log[0].reason == "lag"
    assert log[0].removed == L * H * (len(tool) - math.ceil(0.5 * len(tool)))
    lengths = eng.manager.seq_lengths("kr")
    assert int(lengths.max()) == out.turn_start + len(tool) + len(out.token_ids) - 1 - (
        len(tool) - math.ceil(0.5 * len(tool))
    )
    run_turn(eng, "kr", next_turn(eng, "How many red balls are there?"), GREEDY)


def test_eight_sessions_share_one_system_prompt(smol_engine):
    eng = smol_engine
    base = eng.pool.num_used  # the engine is shared: earlier tests may leave cached prefix holders
    system = "You are a careful assistant. " + haystack(56)
    prompts = [first_turn(eng, f"Question {i}: what color is item {i}?", system=system) for i in range(8)]
    shared = len(eng.apply_chat_template([{"role": "system", "content": system}], add_generation_prompt=False))
    assert shared >= 500
    short = SamplingParams(max_tokens=4)  # what is checked is the shared prefix, not the reply
    outs = [run_turn(eng, f"sp{i}", p, short, shared_prefix=shared) for i, p in enumerate(prompts)]
    # the session that made the holder and one that forked it answer as unshared runs do
    assert [o.token_ids for o in outs[:2]] == [fresh(eng, p, short) for p in prompts[:2]]
    full = shared // P
    assert outs[0].counters.reused_tokens == 0
    assert all(o.counters.reused_tokens == full * P for o in outs[1:])
    tables = [eng.manager.tables[eng.manager.slot(f"sp{i}")][:, :, :full] for i in range(8)]
    assert all(torch.equal(t, tables[0]) for t in tables)  # one copy of the prefix pages
    own = sum(eng.manager.num_pages(f"sp{i}") - L * H * full for i in range(8))
    assert eng.pool.num_used - base == L * H * full + own
    for i in range(8):
        eng.end_session(f"sp{i}")


def test_more_sessions_than_fit_are_demoted_and_restored_exactly(smol_engine):
    params = SamplingParams(max_tokens=4)
    texts = [haystack(6 + i) + f" Which item is blue? ({i})" for i in range(5)]
    follow = ["Are you sure?", "Thanks."]

    def play(engine):
        outs = {}
        for i, t in enumerate(texts):
            outs[(i, 0)] = run_turn(engine, f"m{i}", first_turn(engine, t), params)
        for turn, t in enumerate(follow, start=1):
            for i in range(len(texts)):
                outs[(i, turn)] = run_turn(engine, f"m{i}", next_turn(engine, t), params)
        return outs

    roomy = play(smol_engine)
    one_session = L * H * math.ceil(220 / P)
    tight = make_engine(None, num_pages=2 * one_session, prefill_chunk_size=128)
    small = play(tight)
    assert {k: o.token_ids for k, o in small.items()} == {k: o.token_ids for k, o in roomy.items()}
    assert tight.chains.demotions > 0
    assert any(o.source_tier == "host" for o in small.values())
    for i in range(len(texts)):
        smol_engine.end_session(f"m{i}")


def test_forked_sessions_continue_independently(smol_engine):
    eng = smol_engine
    used0 = eng.pool.num_used  # shared-prefix holders of earlier tests stay cached
    base = first_turn(eng, "Let's plan a trip. Suggest a city.")
    out0 = run_turn(eng, "parent", base, GREEDY)
    eng.fork_session("parent", "child")
    assert eng.manager.num_pages("child") == eng.manager.num_pages("parent")
    a, b = next_turn(eng, "Somewhere warm, please."), next_turn(eng, "Somewhere cold, please.")
    pa, cb = run_turn(eng, "parent", a, GREEDY), run_turn(eng, "child", b, GREEDY)
    hist = base + out0.token_ids
    assert pa.token_ids == fresh(eng, hist + a)
    assert cb.token_ids == fresh(eng, hist + b)
    assert cb.counters.reused_tokens == len(hist) - 1
    for sid in ("parent", "child"):
        eng.end_session(sid)
    assert eng.pool.num_used == used0


def test_session_errors_and_abort_rollback(smol_engine):
    eng = smol_engine
    t0 = first_turn(eng, "Hello there.")
    out = run_turn(eng, "err", t0, GREEDY)
    hist = t0 + out.token_ids
    with pytest.raises(HistoryMismatch):
        eng.add_turn("err", [], GREEDY, history=hist[:-3] + [5, 6, 7, 8])
    with pytest.raises(TurnIndexMismatch):
        eng.add_turn("err", next_turn(eng, "x"), GREEDY, expected_turn_index=3)
    digest = eng.session_info("err").digest
    eng.add_turn("err", next_turn(eng, "Count to fifty."), SamplingParams(max_tokens=40), expected_turn_index=1)
    with pytest.raises(SessionBusy):
        eng.add_turn("err", next_turn(eng, "again"), GREEDY)
    eng.step()
    eng.step()
    eng.abort("err")  # rolled back: the history and its KV are as before the turn
    info = eng.session_info("err")
    assert info.digest == digest and info.turn_index == 1 and info.state == "idle"
    assert int(eng.manager.seq_lengths("err").max()) <= len(hist)
    again = next_turn(eng, "What is your name?")
    out2 = run_turn(eng, "err", again, GREEDY, history=hist + again)
    assert out2.token_ids == fresh(eng, hist + again)
    eng.end_session("err")


def test_snapshot_bytes_round_trip_to_another_engine(smol_engine):
    eng = smol_engine
    t0 = first_turn(eng, "Pick a number between one and ten.")
    out = run_turn(eng, "snap", t0, GREEDY)
    blob = eng.snapshot_session("snap").to_bytes()
    other = make_engine(None, num_pages=8000, prefill_chunk_size=128)
    other.load_session(SessionSnapshot.from_bytes(blob))
    nxt = next_turn(eng, "Now double it.")
    here, there = run_turn(eng, "snap", nxt, GREEDY), run_turn(other, "snap", nxt, GREEDY)
    assert there.source_tier == "store" and there.counters.prefilled_tokens == len(nxt) + 1
    assert here.token_ids == there.token_ids == fresh(eng, t0 + out.token_ids + nxt)
    broken = bytearray(blob)
    broken[-5] ^= 0xFF
    with pytest.raises(SnapshotError):
        SessionSnapshot.from_bytes(bytes(broken))
    eng.end_session("snap")
