"""The sparse serving path: batched compaction, amortised decode-time eviction, admission by compressed size.

Tiny random Llama models (fast tier). Each test states the property the serving path relies on:

* one compaction over many (sequence, layer) rows leaves the cache exactly as compacting each
  row on its own would (same kept tokens, same pages freed), shared pages included;
* a batch of sessions compressed in one forward pass keeps the same tokens as each session alone;
* streaming_llm with slack never holds more than budget + slack tokens per head, and evicts only
  every ``slack`` steps or so;
* sessions whose logical history exceeds the pool, but whose compressed KV fits, all stay resident
  turn after turn: none is demoted, swapped or recomputed;
* a session preempted mid-turn has its KV swapped to host memory and finishes exactly as it would
  have without the preemption, nothing prefilled twice.
"""

from __future__ import annotations

import copy

import pytest
import torch

from engine.cache.manager import CacheManager
from engine.cache.pages import PagePool
from engine.method_spec import MethodSpec
from engine.sampling import SamplingParams

from tests.conftest import make_engine

GREEDY = SamplingParams(max_tokens=6, ignore_eos=True)


SERVING = dict(num_pages=6000, page_size=8, prefill_chunk_size=64, max_num_batched_tokens=256)
"""The engine settings of this module's tests (a test's own keywords go over them)."""


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, 320, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _head_contents(mgr: CacheManager, seq, layer: int, head: int) -> tuple[list, list]:
    k, _, pos, lengths = mgr.gather(seq, layer)
    n = int(lengths[head])
    return k[head, :n].tolist(), pos[head, :n].tolist()


def _filled_cache(seed: int):
    """Three sequences over two layers with uneven head lengths; the third a fork of the first."""
    g = torch.Generator().manual_seed(seed)
    L, H, D, P = 2, 3, 4, 4
    pool = PagePool(400, P, D, torch.float32, torch.device("cpu"))
    mgr = CacheManager(pool, L, H, 8, 256)
    for s, n in ((0, 37), (1, 22)):
        mgr.open(s)
        slots = mgr.append([s], [n], torch.arange(n))
        pool.write_tokens(
            slots.permute(1, 0, 2).reshape(n, L * H),
            torch.randn(n, L * H, D, generator=g),
            torch.randn(n, L * H, D, generator=g),
        )
        for layer in range(L):  # uneven heads
            mgr.evict(s, layer, [torch.arange(n - 3 * h) for h in range(H)])
    mgr.fork(0, 2)
    return mgr, g


def test_one_compaction_equals_compacting_each_row_alone():
    mgr, g = _filled_cache(0)
    alone = copy.deepcopy(mgr)
    decisions = []
    for s in (0, 1, 2):
        for layer in range(mgr.num_layers):
            lengths = mgr.lengths[mgr.slot(s), layer]
            decisions.append((s, layer, [torch.randperm(int(n), generator=g)[: int(n) // 2 + 1] for n in lengths]))
    protected = {0: 4, 2: 4}
    together = mgr.compact(decisions, protected)
    freed = 0
    for s, layer, keep in decisions:
        freed += alone.compact([(s, layer, keep)], protected).pages_freed
    assert together.pages_freed == freed and mgr.pool.num_free == alone.pool.num_free
    assert torch.equal(mgr.lengths, alone.lengths)
    for s in (0, 1, 2):
        for layer in range(mgr.num_layers):
            for h in range(mgr.num_kv_heads):
                assert _head_contents(mgr, s, layer, h) == _head_contents(alone, s, layer, h)
    # the fork kept its own copy of what it shares with its parent, and the protected prefix stayed
    assert mgr.positions(2)[:, :, :4].eq(torch.arange(4)).all()


def test_compaction_keeps_the_rule_and_frees_what_it_drops():
    mgr, g = _filled_cache(1)
    before = {(s, layer, h): _head_contents(mgr, s, layer, h) for s in (0, 1) for layer in range(2) for h in range(3)}
    keep = {
        (s, layer): [
            torch.sort(torch.randperm(int(n), generator=g)[: int(n) // 3]).values
            for n in mgr.lengths[mgr.slot(s), layer]
        ]
        for s in (0, 1)
        for layer in range(2)
    }
    used = mgr.pool.num_used
    result = mgr.compact([(s, layer, k) for (s, layer), k in keep.items()])
    for (s, layer), k in keep.items():
        for h, idx in enumerate(k):
            ks, ps = before[(s, layer, h)]
            assert _head_contents(mgr, s, layer, h) == ([ks[i] for i in idx], [ps[i] for i in idx])
    assert mgr.pool.num_used == used - result.pages_freed == int((mgr.tables >= 0).sum()) - _shared_extra(mgr)
    with pytest.raises(IndexError):
        mgr.compact([(1, 0, [torch.tensor([0, 99])] * 3)])


def _shared_extra(mgr: CacheManager) -> int:
    """Table entries beyond distinct pages (a fork shares its parent's)."""
    t = mgr.tables[mgr.tables >= 0]
    return t.numel() - t.unique().numel()


@pytest.mark.parametrize("method", ["snapkv", "pyramidkv", "adakv", "streaming_llm"])
def test_sessions_compressed_in_one_pass_keep_what_each_keeps_alone(tiny_models, method):
    path, _ = tiny_models("llama")
    spec = MethodSpec(method, budget=24)
    prompts = [_prompt(90 + 7 * i, i) for i in range(3)]
    batched = make_engine(path, SERVING)
    for i, p in enumerate(prompts):
        batched.add_turn(f"s{i}", p, GREEDY, method=spec)
    while batched.has_unfinished():
        batched.step()
    assert batched.runner.forward_passes < 3 * 4  # the three prompts went through passes together
    for i, p in enumerate(prompts):
        alone = make_engine(path, SERVING)
        alone.add_turn("s", p, GREEDY, method=spec)
        while alone.has_unfinished():
            alone.step()
        assert torch.equal(batched.manager.positions(f"s{i}"), alone.manager.positions("s"))


def test_amortised_eviction_never_holds_more_than_budget_plus_slack(tiny_models):
    path, _ = tiny_models("llama")
    eng = make_engine(path, SERVING)
    budget, slack = 32, 16
    spec = MethodSpec("streaming_llm", budget=budget, method_args={"slack": slack, "n_sink": 4})
    params = SamplingParams(max_tokens=120, ignore_eos=True)
    for i, n in enumerate((20, 40, 70)):  # different phases: the batch is cut together
        eng.add_request(_prompt(n, i), params, request_id=i, method=spec)
    events, longest = 0, []
    while eng.has_unfinished():
        before = eng.controller.evicted_tokens
        eng.step()
        if eng.controller.evicted_tokens > before:
            events += 1
        lengths = [eng.manager.seq_lengths(i) for i in range(3) if eng.manager.has(i)]
        if lengths:
            longest.append(max(int(x.max()) for x in lengths))
    assert max(longest) <= budget + slack
    assert max(longest) > budget  # it did let heads grow past the budget between evictions
    # prefill evictions plus one decode-time eviction per slack-and-sink steps, not one per step
    assert events <= 3 + 120 // slack + 2


def test_compressed_sessions_whose_history_exceeds_the_pool_all_stay_resident(tiny_models):
    path, _ = tiny_models("llama")
    L, H, P = 3, 2, 8
    n_sessions, budget = 6, 32
    turns = [_prompt(160, 10 + t) for t in range(4)]
    # room for every session compressed (budget + one turn's prefill + reply), not for their histories
    pages = n_sessions * L * H * ((budget + 8) // P + 2) + L * H * (160 // P + 8)
    eng = make_engine(path, SERVING, num_pages=pages, prefill_chunk_size=256, max_num_batched_tokens=512)
    history = n_sessions * L * H * (4 * (160 + GREEDY.max_tokens) // P)
    assert history > 2 * pages
    spec = MethodSpec("snapkv", budget=budget, method_args={"window_size": 8})
    tiers = []
    for t, tokens in enumerate(turns):
        for s in range(n_sessions):
            eng.add_turn(f"s{s}", tokens, GREEDY, method=spec if t == 0 else None)
        done = 0
        while done < n_sessions:
            for out in eng.step():
                if out.finished:
                    done += 1
                    tiers.append(out.source_tier)
                    assert out.finish_reason == "length"
    assert tiers[n_sessions:] == ["gpu"] * (len(tiers) - n_sessions)  # every later turn found its KV resident
    stats = eng.stats()
    assert stats.demotions == 0 and stats.swaps == 0 and stats.preemptions == 0
    assert all(eng.session_info(f"s{s}").state == "idle" for s in range(n_sessions))


def test_a_preempted_session_is_swapped_out_and_finishes_as_if_alone(tiny_models):
    path, _ = tiny_models("llama")
    L, H, P = 3, 2, 8
    first = [_prompt(120, 20 + i) for i in range(3)]
    second = [_prompt(150, 30 + i) for i in range(3)]
    params = SamplingParams(max_tokens=40, ignore_eos=True)

    def run(eng):
        outs = {}
        for i in range(3):
            eng.add_turn(f"s{i}", first[i], params)
        while eng.has_unfinished():
            eng.step()
        for i in range(3):
            eng.add_turn(f"s{i}", second[i], params)
        while eng.has_unfinished():
            for out in eng.step():
                if out.finished:
                    outs[out.request_id] = out
        return outs

    roomy = run(make_engine(path, SERVING))
    # the pool holds two sessions' second turns at a time, not three
    tight_pages = 2 * L * H * ((120 + 150 + 2 * 40) // P + 2) + L * H * 4
    tight = make_engine(path, SERVING, num_pages=tight_pages, host_cache_gb=1.0)
    outs = run(tight)
    assert tight.scheduler.swaps > 0 and sum(o.counters.preemptions for o in outs.values()) > 0
    for sid, out in roomy.items():
        assert outs[sid].token_ids == out.token_ids
        # the swapped turn prefilled what it would have anyway: its 150 new tokens, and the last reply
        # token unless the device's decode ran one step ahead and already cached it
        assert outs[sid].counters.prefilled_tokens == out.counters.prefilled_tokens in (150, 151)


def test_snapkv_scoring_every_layer_after_the_pass_keeps_what_layer_by_layer_keeps(tiny_models):
    """SnapKV defers a prompt's scoring to the end of the pass (all layers in one batch of kernels);
    the kept tokens are those of the rule applied layer by layer, shared prefix and chain turns included."""
    path, _ = tiny_models("llama")
    spec = MethodSpec("snapkv", budget=40, method_args={"window_size": 16})
    system = _prompt(70, 99)

    def run(defer: bool) -> dict:
        eng = make_engine(path, SERVING, prefill_chunk_size=128, max_num_batched_tokens=1024)
        method = eng.controller.method_for(spec)
        method._defers = defer
        deferred = []
        record = method.after_prefill_pass
        method.after_prefill_pass = lambda: deferred.append(record()) or deferred[-1]
        kept = {}
        for turn in range(3):
            for i in range(3):
                eng.add_turn(
                    f"s{i}",
                    (system if turn == 0 else []) + _prompt(150 + 11 * i + 7 * turn, 10 * turn + i),
                    GREEDY,
                    method=spec,
                )
            while eng.has_unfinished():
                eng.step()
            kept.update({(turn, i): eng.manager.positions(f"s{i}").clone() for i in range(3)})
        assert any(d is not None for d in deferred) == defer
        return kept

    deferred, layer_by_layer = run(True), run(False)
    assert deferred.keys() == layer_by_layer.keys()
    for key in deferred:
        assert torch.equal(deferred[key], layer_by_layer[key]), key


@pytest.mark.parametrize("defer", [True, False])
def test_a_shared_prefix_is_kept_beside_the_budget_so_heads_stay_one_length(tiny_models, monkeypatch, defer):
    """A session attached to another's cached system prompt keeps that prefix whatever its method
    decides. Even when the rule ranks the prefix highest (as attention sinks make real models do),
    the budget goes to the other tokens: every head keeps prefix + budget, all heads one length."""
    import engine.methods.snapkv as snapkv_module

    rule = snapkv_module.scores_from_window_sums

    def prefers_the_start(summed, w, lengths, kernel_size, pooling):
        scores = rule(summed, w, lengths, kernel_size, pooling)
        noise = torch.rand(scores.shape, generator=torch.Generator().manual_seed(0)).to(scores.device)
        early = 100.0 - torch.arange(scores.shape[-1], device=scores.device) / scores.shape[-1] + noise
        return torch.where(torch.isfinite(scores) & (scores <= w), early, scores)  # the window stays on top

    monkeypatch.setattr(snapkv_module, "scores_from_window_sums", prefers_the_start)
    path, _ = tiny_models("llama")
    budget, system = 40, _prompt(64, 7)
    spec = MethodSpec("snapkv", budget=budget, method_args={"window_size": 16})
    eng = make_engine(path, SERVING, prefill_chunk_size=256, max_num_batched_tokens=1024)
    eng.controller.method_for(spec)._defers = defer
    for i in range(2):  # the second session attaches to the first one's cached prefix
        eng.add_turn(f"s{i}", system + _prompt(150, i), GREEDY, method=spec, shared_prefix=len(system))
        while eng.has_unfinished():
            eng.step()
    protected = eng.controller.protected_len("s1")
    assert protected > 0
    lengths = eng.manager.lengths[eng.manager.slot("s1")]
    generated_in_cache = int(eng.manager.positions("s1").max()) + 1 - len(system) - 150
    assert bool((lengths == protected + budget + generated_in_cache).all()), (lengths, protected, generated_in_cache)
