"""LLMEngine on SmolLM2: continuous batching, streaming_llm eviction, preemption, request errors."""

from __future__ import annotations

import math

import pytest

from engine.method_spec import MethodError, MethodSpec
from engine.llm import RequestError
from engine.sampling import SamplingParams

from tests.conftest import chat, haystack, make_engine

QUESTIONS = [
    "Hi!",
    "What is the capital of France?",
    "List three fruits.",
    "Explain in one sentence why the sky is blue.",
    "Translate 'good morning' into Spanish.",
    "What is 12 times 12? Answer with a number only.",
    "Write a haiku about autumn leaves falling in a quiet park at dusk.",
    haystack(12) + " Which items are red?",
]


def test_batched_equals_alone(smol_engine):
    prompts = [chat(smol_engine, q) for q in QUESTIONS]
    assert len({len(p) for p in prompts}) == len(prompts)
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    alone = [smol_engine.generate([p], params)[0].token_ids for p in prompts]
    passes = smol_engine.runner.forward_passes
    together = smol_engine.generate(prompts, params)
    assert [o.token_ids for o in together] == alone
    # continuous batching: all eight decode side by side, far fewer passes than one by one
    assert smol_engine.runner.forward_passes - passes < 8 * 8


@pytest.fixture(scope="module")
def long_prompt(smol_engine):
    prompt = chat(smol_engine, haystack(109) + " What color is item 3?")
    assert 1000 <= len(prompt) <= 1024
    return prompt


def test_streaming_with_full_budget_equals_dense(smol_engine, long_prompt):
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    dense = smol_engine.generate([long_prompt], params)[0]
    evicted = smol_engine.controller.evicted_tokens
    full = smol_engine.generate(
        [long_prompt], params, method=MethodSpec("streaming_llm", budget=len(long_prompt) + 64)
    )[0]
    assert full.token_ids == dense.token_ids
    assert smol_engine.controller.evicted_tokens == evicted  # nothing evicted


def test_streaming_evicts_and_frees_exactly(long_prompt):
    engine = make_engine(None, num_pages=40000, prefill_chunk_size=1024, max_num_batched_tokens=1024)
    spec = MethodSpec("streaming_llm", budget=68, method_args={"n_sink": 4, "slack": 0})  # the paper's exact rule
    rid = engine.add_request(long_prompt, SamplingParams(max_tokens=8, ignore_eos=True), method=spec)
    L, H, P = 30, 3, 16
    free_before = engine.pool.num_free
    engine.step()  # the whole prompt in one chunk, then eviction to 68 per head
    n = len(long_prompt)
    pages = engine.manager.pages_per_head(rid)
    assert pages.shape == (L, H)
    assert int(pages.max()) <= math.ceil(68 / P) + 1
    assert engine.manager.seq_lengths(rid).eq(68).all()
    evicted = L * H * math.ceil(n / P) - int(pages.sum())
    assert engine.controller.evicted_pages == evicted
    assert free_before - engine.pool.num_free == int(pages.sum())  # the pool got back all it lent but the kept pages
    assert engine.controller.evicted_tokens == L * H * (n - 68)
    # decoding keeps every head at its budget
    while engine.has_unfinished():
        engine.step()
        if engine.manager.has(rid):
            assert int(engine.manager.seq_lengths(rid).max()) <= 68
    assert engine.pool.num_free == engine.pool.num_pages


def test_pool_for_two_runs_six(smol_engine):
    prompts = [chat(smol_engine, haystack(8 + i) + f" Question {i}: which item is blue?") for i in range(6)]
    params = SamplingParams(max_tokens=32, ignore_eos=True)
    free = [o.token_ids for o in smol_engine.generate(prompts, params)]
    L, H, P = 30, 3, 16
    longest = max(len(p) for p in prompts) + params.max_tokens
    # room for two sequences at their prompt length, not for two at full length
    pages = 2 * L * H * math.ceil((max(len(p) for p in prompts) + 8) / P) + 2 * L * H
    assert pages < 2 * L * H * math.ceil(longest / P)
    engine = make_engine(None, num_pages=pages, prefill_chunk_size=128, max_num_batched_tokens=1024)
    outs = engine.generate(prompts, params)
    assert [o.token_ids for o in outs] == free
    assert all(o.finish_reason == "length" for o in outs)
    assert engine.scheduler.preemptions > 0
    assert engine.pool.num_free == engine.pool.num_pages


def test_sampling_controls(smol_engine):
    prompt = chat(smol_engine, "Tell me about the ocean.")
    greedy = smol_engine.generate([prompt], SamplingParams(max_tokens=10, ignore_eos=True))[0].token_ids
    top1 = smol_engine.generate(
        [prompt], SamplingParams(max_tokens=10, temperature=0.8, top_k=1, seed=3, ignore_eos=True)
    )[0]
    assert top1.token_ids == greedy
    hot = SamplingParams(max_tokens=10, temperature=1.5, seed=11, ignore_eos=True)
    a, b = smol_engine.generate([prompt, prompt], [hot, hot])
    assert a.token_ids == b.token_ids  # the same seed gives the same tokens in one batch
    c = smol_engine.generate([prompt], SamplingParams(max_tokens=10, temperature=1.5, seed=12, ignore_eos=True))[0]
    assert c.token_ids != a.token_ids
    tiny_p = smol_engine.generate(
        [prompt], SamplingParams(max_tokens=10, temperature=1.0, top_p=1e-6, seed=5, ignore_eos=True)
    )[0]
    assert tiny_p.token_ids == greedy


def test_stop_token_string_and_length(smol_engine):
    prompt = chat(smol_engine, "Count from 1 to 20, separated by commas.")
    full = smol_engine.generate([prompt], SamplingParams(max_tokens=24))[0]
    assert "5" in full.text
    cut = smol_engine.generate([prompt], SamplingParams(max_tokens=24, stop=["5"]))[0]
    assert cut.finish_reason == "stop" and "5" not in cut.text and full.text.startswith(cut.text)
    stop_id = full.token_ids[3]
    by_id = smol_engine.generate([prompt], SamplingParams(max_tokens=24, stop_token_ids=[stop_id]))[0]
    assert by_id.token_ids == full.token_ids[: full.token_ids.index(stop_id) + 1] and by_id.finish_reason == "stop"
    short = smol_engine.generate([prompt], SamplingParams(max_tokens=3))[0]
    assert short.finish_reason == "length" and len(short.token_ids) == 3
    eos = smol_engine.generate([chat(smol_engine, "What is the capital of France?")], SamplingParams(max_tokens=50))[0]
    assert eos.finish_reason == "stop" and eos.token_ids[-1] in smol_engine.eos_token_ids


def test_streamed_text_adds_up(smol_engine):
    prompt = chat(smol_engine, "Name two planets and a star, with an emoji each.")
    rid = smol_engine.add_request(prompt, SamplingParams(max_tokens=24, stop=["Mars"]))
    pieces, final = [], None
    while final is None:
        for out in smol_engine.step():
            if out.request_id == rid:
                pieces.append(out.new_text)
                final = out if out.finished else None
    assert "".join(pieces) == final.text


def test_bad_requests_are_refused_cleanly(smol_engine):
    used0 = smol_engine.pool.num_used  # shared-prefix holders other tests left cached
    with pytest.raises(RequestError):
        smol_engine.add_request([], SamplingParams())
    with pytest.raises(RequestError):
        smol_engine.add_request([10**9], SamplingParams())
    with pytest.raises(RequestError):
        smol_engine.add_request(list(range(10, 9000)), SamplingParams())  # longer than max_model_len
    with pytest.raises(MethodError):
        smol_engine.add_request([1, 2, 3], method=MethodSpec("no_such_method"))
    with pytest.raises(MethodError):
        smol_engine.add_request([1, 2, 3], method=MethodSpec("streaming_llm"))  # needs a budget
    with pytest.raises(MethodError):
        smol_engine.add_request([1, 2, 3], method=MethodSpec("streaming_llm", budget=8, method_args={"bogus": 1}))
    with pytest.raises(ValueError):
        SamplingParams(max_tokens=-1)
    rid = smol_engine.add_request([1, 2, 3], SamplingParams(max_tokens=5))
    with pytest.raises(RequestError):
        smol_engine.add_request([1, 2, 3], request_id=rid)
    out = smol_engine.abort(rid)
    assert out.finished and out.finish_reason == "abort"
    assert not smol_engine.has_unfinished()
    assert smol_engine.pool.num_used == used0


@pytest.mark.slow
def test_request_larger_than_pool_is_refused():
    engine = make_engine(None, num_pages=200, prefill_chunk_size=64, max_num_batched_tokens=256)
    with pytest.raises(RequestError, match="KV pages"):
        engine.add_request(list(range(100, 400)), SamplingParams(max_tokens=8))
