"""kvzip: a budget that holds the context equals dense (with and without the reconstruction pass),
the kept tokens are exactly those the HF model's own reconstruction attention ranks highest, and
the extra pass leaves no KV and no pages behind."""

from __future__ import annotations

import math

import pytest
import torch

from engine.lifecycle import ScoringPass
from engine.method_spec import MethodSpec
from engine.sampling import SamplingParams

from tests.conftest import chat, haystack, make_engine


def _always_score(engine, spec):
    """Make the spec's kvzip instance run its pass even when the budget holds everything."""
    m = engine.controller.method_for(spec)
    m.scoring_pass = lambda seq, ids, tok: ScoringPass(m.reconstruction_segments(ids, tok))
    return m


def _run_all(engine, ids):
    outs = {}
    while len(outs) < len(ids):
        for o in engine.step():
            if o.finished:
                outs[o.request_id] = o.token_ids
    return outs


def test_full_budget_equals_dense(smol_engine):
    prompt = chat(smol_engine, haystack(6) + " What color is item 3?")
    params = SamplingParams(max_tokens=32, ignore_eos=True)
    budget = len(prompt) + 32
    forced = MethodSpec("kvzip", budget=budget, method_args={"chunk_size": 40})
    m = _always_score(smol_engine, forced)
    passes = []
    orig = m.after_scoring
    m.after_scoring = lambda seq: (passes.append(seq.seq_id), orig(seq))[1]
    evicted = smol_engine.controller.evicted_tokens
    ids = {
        "dense": smol_engine.add_request(prompt, params),
        "kvzip": smol_engine.add_request(prompt, params, method=MethodSpec("kvzip", budget=budget)),
        "forced": smol_engine.add_request(prompt, params, method=forced),
    }
    outs = _run_all(smol_engine, ids.values())
    assert len(outs[ids["dense"]]) == 32
    assert outs[ids["kvzip"]] == outs[ids["dense"]]
    assert outs[ids["forced"]] == outs[ids["dense"]]  # the pass ran and left the cache as it was
    assert passes == [ids["forced"]]
    assert smol_engine.controller.evicted_tokens == evicted


# --- the rule, against the HF model's own attention ------------------------------------------------
N, B, SINK, CHUNK = 48, 16, 4, 20


@pytest.fixture(scope="module")
def tiny(tiny_models):
    path, hf = tiny_models("llama")  # 3 layers, 4 query heads, 2 kv-heads, head_dim 16
    engine = make_engine(
        path, device="cpu", num_pages=4000, page_size=4, prefill_chunk_size=16, max_num_batched_tokens=64
    )
    return engine, hf


def _prompt():
    return torch.randint(0, 320, (N,), generator=torch.Generator().manual_seed(11)).tolist()


def _kept_positions(engine, rid):
    return [
        [sorted(int(p) for p in row if p >= 0) for row in engine.manager.gather(rid, layer)[2]]
        for layer in range(engine.shape.num_layers)
    ]


def test_kvzip_rule(tiny):
    engine, hf = tiny
    spec = MethodSpec("kvzip", budget=B, method_args={"chunk_size": CHUNK, "n_sink": SINK})
    m = engine.controller.method_for(spec)
    prompt = _prompt()
    segments = m.reconstruction_segments(prompt, None)  # no tokenizer: the chunks themselves
    assert [len(s) for s in segments] == [20, 20, 8]
    # the rule: each segment follows the whole context; a context token's score is the largest
    # attention any segment query of its kv-head's group gives it
    L, Hq, H = engine.shape.num_layers, engine.shape.num_heads, engine.shape.num_kv_heads
    best = torch.full((L, H, N), float("-inf"))
    with torch.no_grad():
        for seg in segments:
            att = hf(torch.tensor([prompt + seg]), output_attentions=True).attentions
            for layer in range(L):
                a = att[layer][0, :, N:, :N].float()  # [Hq, n, N]
                best[layer] = torch.maximum(best[layer], a.reshape(H, Hq // H * a.shape[1], N).amax(1))
    best[:, :, :SINK] = float("inf")

    rid = engine.add_request(prompt, SamplingParams(max_tokens=2, ignore_eos=True), method=spec)
    while engine._seqs[rid].num_cached < N:  # the step that prefills the last chunk also compresses
        engine.step()
    kept = _kept_positions(engine, rid)
    engine.abort(rid)
    for layer in range(L):
        for h in range(H):
            want = sorted(best[layer, h].topk(B).indices.tolist())
            assert kept[layer][h] == want, (layer, h)


def test_pass_frees_pages_and_leaves_nothing(tiny):
    engine, _ = tiny
    spec = MethodSpec("kvzip", budget=B, method_args={"chunk_size": CHUNK})
    m = engine.controller.method_for(spec)
    free = {}
    orig_pass, orig_after = m.scoring_pass, m.after_scoring

    def scoring_pass(seq, ids, tok):
        free["before"] = engine.pool.num_free
        return orig_pass(seq, ids, tok)

    def after_scoring(seq):
        free["after_pass"] = engine.pool.num_free
        return orig_after(seq)

    m.scoring_pass, m.after_scoring = scoring_pass, after_scoring
    evicted = engine.controller.evicted_pages
    rid = engine.add_request(_prompt(), SamplingParams(max_tokens=3, ignore_eos=True), method=spec)
    while "after_pass" not in free:
        engine.step()
    P, L, H = engine.manager.page_size, engine.shape.num_layers, engine.shape.num_kv_heads
    assert free["after_pass"] == free["before"]  # the reconstruction tokens are gone, pages and all
    assert engine.manager.seq_lengths(rid).eq(B).all()
    assert engine.manager.pages_per_head(rid).eq(math.ceil(B / P)).all()
    freed = L * H * (math.ceil(N / P) - math.ceil(B / P))
    assert engine.pool.num_free == free["before"] + freed
    assert engine.controller.evicted_pages - evicted == freed
    engine.abort(rid)
    while engine.has_unfinished():
        engine.step()


def test_chain_session_turns_reconstruct_the_whole_history(tiny):
    """A session's second turn scores every cached token by reconstructing the whole history."""
    engine, _ = tiny
    spec = MethodSpec("kvzip", budget=B, method_args={"chunk_size": CHUNK})
    m = engine.controller.method_for(spec)
    seen = []
    orig = m.scoring_pass
    m.scoring_pass = lambda seq, ids, tok: (seen.append(list(ids)), orig(seq, ids, tok))[1]
    sid = "kvzip-session"
    for turn in (_prompt(), [5, 6, 7, 8, 9, 10, 11, 12]):
        engine.add_turn(sid, turn, SamplingParams(max_tokens=4, ignore_eos=True), method=spec)
        while engine.has_unfinished():
            engine.step()
        assert engine.manager.seq_lengths(sid).eq(B + 3).all()  # the budget, then 3 decoded tokens cached
    assert len(seen) == 2 and seen[1][:N] == _prompt() and len(seen[1]) == N + 4 + 8
    engine.end_session(sid)


def test_pool_too_small_for_the_pass_keeps_everything(tiny_models, caplog):
    """No room for a reconstruction segment: the pass is skipped (with a warning), nothing is
    evicted, and the sequence carries on uncompressed."""
    path, _ = tiny_models("llama")
    # the context takes 72 pages, a segment 30
    engine = make_engine(
        path, device="cpu", num_pages=90, page_size=4, prefill_chunk_size=16, max_num_batched_tokens=64
    )
    spec = MethodSpec("kvzip", budget=B, method_args={"chunk_size": CHUNK})
    rid = engine.add_request(_prompt(), SamplingParams(max_tokens=2, ignore_eos=True), method=spec)
    with caplog.at_level("WARNING", logger="engine.runner"):
        while engine._seqs[rid].num_cached < N:
            engine.step()
    assert "scoring pass" in caplog.text
    assert engine.manager.seq_lengths(rid).eq(N).all() and engine.controller.evicted_tokens == 0
    while engine.has_unfinished():
        engine.step()
    assert engine.pool.num_free == 90
