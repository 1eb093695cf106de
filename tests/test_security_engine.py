"""One request must not stop the engine, nor learn about another tenant's prompts (issue 18, classes 4-5),
on a tiny random model:

* every sampling field is validated (hypothesis tries NaN, infinities, denormals, huge and negative values,
  bools): a value is either refused with SamplingError or samples a valid token;
* a failure injected into one sequence's sampling fails that request alone (finish "failed", its turn
  rolled back) while the other sessions in the batch finish exactly as they would alone, and the failed
  session takes its next turn;
* a forward pass that raises fails the requests in it (their turns rolled back) and the engine steps on,
  on the run-ahead decode path too (driven on the CPU by eager stand-in graphs); passes that keep failing
  stop it;
* prefix sharing is partitioned by scope (the tenant): a session reuses a prefix of its own scope only;
  an explicitly public prefix is shared.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import engine.sampling as sampling
from engine.attention.paged import PagedAttention
from engine.method_spec import MethodSpec
from engine.llm import LLMEngine
from engine.sampling import SamplingError, SamplingParams, sample

from tests.conftest import make_engine, run_turn

_FLOATS = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from(
        [
            0.0,
            -0.0,
            1e-300,
            1e-40,
            5e-324,
            1e-5,
            1e-4,
            1e300,
            -1.0,
            float("nan"),
            float("inf"),
            -float("inf"),
            100.0,
            100.1,
        ]
    ),
    st.booleans(),
    st.integers(-(2**70), 2**70),
)
_INTS = st.one_of(st.integers(-(2**70), 2**70), st.booleans(), st.floats(allow_nan=True))


@settings(max_examples=400, deadline=None)
@given(
    temperature=_FLOATS,
    top_p=_FLOATS,
    top_k=_INTS,
    seed=st.one_of(st.none(), _INTS),
    big=st.sampled_from([1.0, 1e4, 1e30, 3e38]),
)
def test_sampling_fields_are_refused_or_sample_a_valid_token(temperature, top_p, top_k, seed, big):
    try:
        p = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed)
    except SamplingError:
        return
    assert math.isfinite(p.temperature) and 0 <= p.temperature <= 100 and 0 < p.top_p <= 1
    V = 50
    logits = torch.randn(2, V) * big
    logits[1, 3] = float("inf")  # a damaged row as well
    gen = torch.Generator().manual_seed(p.seed) if p.seed is not None else None
    tokens, errors = sample(logits, [p, p], [gen, gen])
    assert errors[0] is None and 0 <= tokens[0] < V


@pytest.mark.parametrize("stop", [["x" * 257], ["a"] * 17, [""], ["ok", 5]])
def test_stop_strings_are_bounded(stop):
    with pytest.raises(SamplingError):
        SamplingParams(stop=stop)


def test_a_row_without_a_finite_logit_fails_alone():
    logits = torch.randn(3, 20)
    logits[1] = float("nan")
    p = SamplingParams(temperature=0.7, seed=1)
    tokens, errors = sample(logits, [p, p, p], [torch.Generator().manual_seed(i) for i in range(3)])
    assert errors[1] and tokens[1] is None
    assert errors[0] is None and errors[2] is None and tokens[0] is not None and tokens[2] is not None


@pytest.fixture(scope="module")
def new_engine(tiny_models):
    """Builds a fresh engine on the tiny llama at each call (these tests break engines on purpose)."""
    folder, _ = tiny_models("llama")
    return lambda: make_engine(folder, num_pages=800, prefill_chunk_size=32, page_size=16)


def _run_together(eng: LLMEngine, turns: dict[str, tuple[list[int], SamplingParams]]) -> dict:
    for sid, (tokens, params) in turns.items():
        eng.add_turn(sid, tokens, params)
    done = {}
    while len(done) < len(turns):
        assert eng.has_unfinished()
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out
    return done


def test_a_failure_in_one_sequences_sampling_leaves_the_others_running(new_engine, monkeypatch):
    prompts = {f"s{i}": list(range(10 + i, 40 + i)) for i in range(4)}
    params = {sid: SamplingParams(max_tokens=8, temperature=0.8, seed=100 + i) for i, sid in enumerate(prompts)}
    params["s2"] = SamplingParams(max_tokens=8, temperature=0.8, seed=666)  # the one that will fail

    alone = {}
    for sid, toks in prompts.items():
        if sid != "s2":
            eng = new_engine()
            alone[sid] = run_turn(eng, sid, toks, params[sid]).token_ids

    real = sampling.sample_row

    def faulty(row, p, gen):
        if p.seed == 666:
            raise RuntimeError("injected: probability tensor contains either inf, nan or element < 0")
        return real(row, p, gen)

    eng = new_engine()
    monkeypatch.setattr(sampling, "sample_row", faulty)
    outs = _run_together(eng, {sid: (toks, params[sid]) for sid, toks in prompts.items()})
    assert outs["s2"].finish_reason == "failed" and "injected" in outs["s2"].error
    for sid in alone:
        assert outs[sid].finish_reason in ("stop", "length") and outs[sid].token_ids == alone[sid]
    # the failed turn was rolled back; the session (and the engine) go on
    assert eng.session_info("s2").turn_index == 0
    monkeypatch.setattr(sampling, "sample_row", real)
    again = run_turn(eng, "s2", prompts["s2"], SamplingParams(max_tokens=4, temperature=0.8, seed=7))
    assert again.finish_reason in ("stop", "length") and len(again.token_ids) >= 1
    assert eng.stats().pages_free >= 0 and eng.totals["finished_failed"] == 1


def test_a_failure_processing_one_sequences_token_fails_it_alone(new_engine, monkeypatch):
    eng = new_engine()
    real = eng.loop._append_token

    def faulty(seq, token, now, at=None):
        if seq.seq_id == "bad":
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected")
        return real(seq, token, now, at=at)

    monkeypatch.setattr(eng.loop, "_append_token", faulty)
    outs = _run_together(
        eng,
        {
            "bad": (list(range(5, 30)), SamplingParams(max_tokens=4)),
            "good": (list(range(7, 33)), SamplingParams(max_tokens=4)),
        },
    )
    assert outs["bad"].finish_reason == "failed" and outs["good"].finish_reason in ("stop", "length")


def test_a_failed_forward_pass_fails_its_requests_and_the_engine_steps_on(new_engine, monkeypatch):
    """A pass that raises (out of memory, a kernel's error) fails the requests in it, their turns rolled back
    (mid-prefill too), and nothing else: the sessions then continue exactly as if the failed turn had never
    run, and every page comes back."""
    first, second = list(range(10, 50)), list(range(60, 75))
    long_prompt = list(range(100, 200))  # four prefill chunks of 32
    greedy = SamplingParams(max_tokens=6)
    ref = new_engine()
    run_turn(ref, "a", first, greedy)
    expected = run_turn(ref, "a", second, greedy).token_ids
    expected_b = run_turn(ref, "b", long_prompt, greedy).token_ids

    eng = new_engine()
    free_at_start = eng.stats().pages_free
    run_turn(eng, "a", first, greedy)
    real, calls = eng.loop.runner.execute, {"b": 0}

    def faulty(batch, windows):
        if any(s.seq_id == "b" for s, _ in batch.prefill):
            calls["b"] += 1
            if calls["b"] == 2:  # b's second chunk, with a's turn in the same pass
                raise RuntimeError("injected: CUDA out of memory")
        return real(batch, windows)

    monkeypatch.setattr(eng.loop.runner, "execute", faulty)
    outs = _run_together(eng, {"a": (second, greedy), "b": (long_prompt, greedy)})
    assert outs["b"].finish_reason == "failed" and "injected" in outs["b"].error
    failed = [sid for sid, o in outs.items() if o.finish_reason == "failed"]
    assert eng.totals["finished_failed"] == len(failed) and eng.loop.failed_passes == 1
    assert eng.session_info("a").turn_index == (1 if "a" in failed else 2)
    monkeypatch.setattr(eng.loop.runner, "execute", real)
    if "a" in failed:  # rolled back: the same turn again gives the reference's tokens
        assert run_turn(eng, "a", second, greedy).token_ids == expected
    else:
        assert outs["a"].token_ids == expected
    assert run_turn(eng, "b", long_prompt, greedy).token_ids == expected_b
    assert eng.loop.failed_passes == 0
    for sid in ("a", "b"):
        eng.end_session(sid)
    assert eng.stats().pages_free == free_at_start


class EagerDecodeGraphs:
    """DecodeGraphs' contract (``max_batch``, ``run``) computed eagerly, so that the run-ahead decode path
    (``ModelRunner.launch_decode``, ``StepLoop`` one step ahead) runs on the CPU."""

    max_batch = 64

    def __init__(self, runner):
        self.runner = runner
        self.replays = 0

    def run(self, input_ids, positions, rows, slot_mapping, method=None):
        r = self.runner
        seq_at = {slot: sid for sid, slot in r.manager._slot_of.items()}
        ids = [seq_at[int(row)] for row in rows]
        attend = PagedAttention(
            r.manager, r.controller, r.backend, r.scale, ids, (positions + 1).tolist(), [], slot_mapping, positions
        )
        self.replays += 1
        return r.model(input_ids, positions, attend)


@pytest.mark.parametrize("where", ["replay", "compaction"])
def test_a_failed_run_ahead_step_fails_its_requests_and_the_engine_steps_on(new_engine, monkeypatch, where):
    """The run-ahead decode path shares the ordinary path's failure handling: a launched step that raises
    (in the replay, or out of memory in the eviction compaction after it) fails the requests in it, their
    turns rolled back, the step before it still completes, and the engine steps on. Dense sessions then
    continue exactly as if the failed turn had never run; streaming_llm keeps what it evicted from the
    history during the failed turn (ChainCache.abort_turn), so there only the session without history
    repeats the reference exactly."""
    method = None if where == "replay" else MethodSpec("streaming_llm", budget=24, method_args={"slack": 2})
    first, second, other = list(range(10, 50)), list(range(60, 75)), list(range(100, 130))
    greedy = SamplingParams(max_tokens=12)
    ref = new_engine()
    expected_first = run_turn(ref, "a", first, greedy, method=method).token_ids
    expected = run_turn(ref, "a", second, greedy).token_ids
    expected_b = run_turn(ref, "b", other, greedy, method=method).token_ids

    eng = new_engine()
    graphs = eng.loop.runner.graphs = EagerDecodeGraphs(eng.loop.runner)
    free_at_start = eng.stats().pages_free
    assert run_turn(eng, "a", first, greedy, method=method).token_ids == expected_first  # run ahead, on the CPU
    assert graphs.replays >= 10
    state = {"launches": 0, "in_launch": False, "failed": 0}
    real_launch, real_run, real_take = eng.loop.runner.launch_decode, graphs.run, eng.pool.format.take_tokens

    def launch(batch, previous):
        state["launches"] += 1
        state["in_launch"] = len(batch.decode) == 2  # a and b decode together, one step ahead
        try:
            return real_launch(batch, previous)
        finally:
            state["in_launch"] = False

    def fault(real):
        def faulty(*args, **kwargs):
            if state["in_launch"] and state["launches"] >= 3 and not state["failed"]:
                state["failed"] += 1
                raise torch.OutOfMemoryError("injected: CUDA out of memory")
            return real(*args, **kwargs)

        return faulty

    monkeypatch.setattr(eng.loop.runner, "launch_decode", launch)
    if where == "replay":
        monkeypatch.setattr(graphs, "run", fault(real_run))
    else:  # the eviction decided after the replay: compaction's gather runs out of memory
        monkeypatch.setattr(eng.pool.format, "take_tokens", fault(real_take))
    eng.add_turn("b", other, greedy, method=method)
    outs = _run_together(eng, {"a": (second, greedy)})
    while "b" not in outs:
        outs.update({o.request_id: o for o in eng.step() if o.finished})
    assert state["failed"] == 1
    assert all(o.finish_reason == "failed" and "injected" in o.error for o in outs.values())
    assert eng.totals["finished_failed"] == 2 and eng.loop.failed_passes == 1 and eng.loop.inflight is None
    assert eng.session_info("a").turn_index == 1 and eng.session_info("b").turn_index == 0
    # rolled back: the same turns again give the reference's tokens, one step ahead again
    replays = graphs.replays
    retried = run_turn(eng, "a", second, greedy)
    assert retried.finish_reason == "length" and (method is not None or retried.token_ids == expected)
    assert run_turn(eng, "b", other, greedy, method=method).token_ids == expected_b
    assert eng.loop.failed_passes == 0 and graphs.replays > replays
    for sid in ("a", "b"):
        eng.end_session(sid)
    assert eng.stats().pages_free == free_at_start


def test_forward_passes_that_keep_failing_stop_the_engine(new_engine, monkeypatch):
    from engine.stepping import MAX_FAILED_PASSES

    eng = new_engine()

    def broken(batch, windows):
        raise RuntimeError("injected: device lost")

    monkeypatch.setattr(eng.loop.runner, "execute", broken)
    for i in range(MAX_FAILED_PASSES - 1):  # each pass fails its request; the engine steps on
        eng.add_request(list(range(5, 20)), SamplingParams(max_tokens=2), request_id=f"r{i}")
        (out,) = eng.step()
        assert out.finished and out.finish_reason == "failed"
    eng.add_request(list(range(5, 20)), SamplingParams(max_tokens=2), request_id="last")
    with pytest.raises(RuntimeError, match="device lost"):
        eng.step()


def test_prefix_sharing_stays_within_its_scope(new_engine):
    eng = new_engine()
    system = list(range(100, 100 + 64))  # four full pages a session may share
    q = lambda i: system + list(range(300 + i, 310 + i))  # noqa: E731
    p = SamplingParams(max_tokens=2)
    first = run_turn(eng, "a1", q(0), p, shared_prefix=64, prefix_scope="tenant:alpha")
    assert first.counters.reused_tokens == 0
    # tenant beta sending alpha's exact prompt reuses nothing: no hint that alpha sent it
    guess = run_turn(eng, "b1", q(1), p, shared_prefix=64, prefix_scope="tenant:beta")
    assert guess.counters.reused_tokens == 0
    # alpha's own next session shares it
    own = run_turn(eng, "a2", q(2), p, shared_prefix=64, prefix_scope="tenant:alpha")
    assert own.counters.reused_tokens == 64
    # a public prefix is shared by whoever marks it public
    run_turn(eng, "pub1", q(3), p, shared_prefix=64, prefix_scope="")
    shared = run_turn(eng, "pub2", q(4), p, shared_prefix=64, prefix_scope="")
    assert shared.counters.reused_tokens == 64
    # and the same tokens as tenant beta's (second) session now reuse beta's own holder only
    assert run_turn(eng, "b2", q(5), p, shared_prefix=64, prefix_scope="tenant:beta").counters.reused_tokens == 64
