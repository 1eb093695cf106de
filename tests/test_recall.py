"""The recall tier (``<method>+recall``): the cold store's bounds and moves, the engine's recall rule
recomputed here, the budget, snapshots, forks, the host bound and hostile settings. Tiny random
models: the fast tier (the real-model needle test is in tests/test_recall_needle.py)."""

from __future__ import annotations

import pytest
import torch

from engine.cache.cold_store import ColdStore
from engine.method_spec import MethodError, MethodSpec
from engine.methods import get_method_class
from engine.sampling import SamplingParams
from engine.recall import _pooled, _score

from tests.conftest import make_engine, run_turn

GREEDY = SamplingParams(max_tokens=6, ignore_eos=True)
L, H, D, P = 2, 3, 8, 4


# --- 1. the cold store ------------------------------------------------------------------------------
def _fill(store: ColdStore, n_per_row: list[int], seed: int = 0) -> dict:
    """Append ``n_per_row[r]`` random tokens to each row (in two rounds); returns row -> (k, v, pos)."""
    g = torch.Generator().manual_seed(seed)
    truth = {r: ([], [], []) for r in range(L * H)}
    for half in (0, 1):
        rows, ks, vs, ps = [], [], [], []
        for r, n in enumerate(n_per_row):
            m = n // 2 if half == 0 else n - n // 2
            k, v = torch.randn(m, D, generator=g), torch.randn(m, D, generator=g)
            pos = torch.arange(m) + 1000 * half + 10 * r
            rows.append(torch.full((m,), r))
            ks.append(k), vs.append(v), ps.append(pos)
            truth[r][0].append(k), truth[r][1].append(v), truth[r][2].append(pos)
        store.append(torch.cat(rows), torch.cat(ks), torch.cat(vs), torch.cat(ps))
    return {r: tuple(torch.cat(x) for x in t) for r, t in truth.items()}


@pytest.mark.parametrize("fmt", ["plain", "fp8"])
def test_block_bounds_cover_every_cold_key(fmt):
    store = ColdStore(L, H, D, P, torch.float32, torch.device("cpu"), fmt)
    truth = _fill(store, [0, 5, 13, 4, 9, 22])
    q = torch.randn(L, H, 7, D)
    bound = store.block_scores(q)  # [L, H, NB]
    for r, (k, _, _) in truth.items():
        layer, head = divmod(r, H)
        if fmt == "fp8":  # the bounds hold for the keys as stored (what a recall returns)
            s = (k.abs().amax(-1, keepdim=True) / 448).clamp(min=1e-12)
            k = (k / s).to(torch.float8_e4m3fn).float() * s
        for b in range(bound.shape[-1]):
            keys = k[b * P : (b + 1) * P]
            if len(keys) == 0:
                assert bound[layer, head, b] == float("-inf")
            else:
                exact = (q[layer, head] @ keys.T).max()
                assert bound[layer, head, b] >= exact - 1e-5


@pytest.mark.parametrize("fmt", ["plain", "fp8"])
def test_take_returns_blocks_and_the_rest_survive_compaction_and_snapshot(fmt):
    store = ColdStore(L, H, D, P, torch.float32, torch.device("cpu"), fmt)
    truth = _fill(store, [8, 5, 13, 4, 9, 22])
    tol = 0.0 if fmt == "plain" else 0.07
    blocks = torch.full((L, H, 2), -1, dtype=torch.int64)
    blocks[0, 0] = torch.tensor([1, -1])  # row 0: its second block
    blocks[1, 2] = torch.tensor([0, 5])  # row 5: blocks 0 and 5 (the partly filled last one)
    got = store.take(blocks)
    k0 = got.k[0, 0][got.pos[0, 0] >= 0]
    assert torch.allclose(k0, truth[0][0][4:8], atol=tol * k0.abs().max())
    assert sorted(got.pos[1, 2][got.pos[1, 2] >= 0].tolist()) == sorted(
        truth[5][2][0:4].tolist() + truth[5][2][20:22].tolist()
    )
    taken = {0: set(truth[0][2][4:8].tolist()), 5: set(truth[5][2][0:4].tolist() + truth[5][2][20:22].tolist())}

    def live_positions(s: ColdStore) -> dict:
        live = ~s.dead.repeat_interleave(P, -1)[..., : s.capacity] & (torch.arange(s.capacity) < s.count[..., None])
        return {r: set(s.pos[r // H, r % H][live[r // H, r % H]].tolist()) for r in range(L * H)}

    want = {r: set(t[2].tolist()) - taken.get(r, set()) for r, t in truth.items()}
    assert live_positions(store) == want
    assert store.live_tokens() == sum(len(w) for w in want.values())
    store.compact()
    assert live_positions(store) == want
    again = ColdStore(L, H, D, P, torch.float32, torch.device("cpu"), fmt)
    again.load(store.state())
    assert live_positions(again) == want
    q = torch.randn(L, H, 3, D)
    a, b = again.block_scores(q), store.block_scores(q)
    w = min(a.shape[-1], b.shape[-1])
    assert torch.equal(a[..., :w], b[..., :w])
    assert bool((a[..., w:] == float("-inf")).all()) and bool((b[..., w:] == float("-inf")).all())
    # appending after a taken partly filled last block starts a fresh block (bounds stay exact)
    store.append(torch.tensor([5]), torch.ones(1, D), torch.ones(1, D), torch.tensor([9999]))
    assert 9999 in live_positions(store)[5]


# --- 2. the engine -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_path(tiny_models):
    return tiny_models("llama")[0]  # 3 layers, 4 query heads, 2 kv-heads, head_dim 16


ENGINE = dict(device="cpu", num_pages=4000, page_size=4, prefill_chunk_size=64)
"""The engine settings of this module's engine tests (a test's own keywords go over them)."""


def _turns(seed: int, sizes=(90, 40, 40)) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 300, (n,), generator=g).tolist() for n in sizes]


def _chat(engine, sid, turns, spec, params=GREEDY, check=None):
    outs = []
    for i, t in enumerate(turns):
        outs.append(run_turn(engine, sid, t, params, method=spec if i == 0 else None).token_ids)
        if check is not None:
            check(i)
    return outs


def test_full_budget_recall_equals_dense(tiny_path):
    engine = make_engine(tiny_path, ENGINE)
    turns = _turns(1)
    dense = _chat(engine, "d", turns, None)
    full = _chat(engine, "r", turns, MethodSpec("snapkv+recall", budget=1000))
    assert full == dense
    assert engine.controller.recall.cold_tokens("r") == 0


def test_without_recall_a_variant_is_its_base_until_something_is_recalled(tiny_path):
    """Turn 1 of snapkv+recall at a budget of 24 with ``recall_scope="earlier"`` (nothing an earlier
    turn evicted to recall) gives the tokens of snapkv at its share of the budget (18: a quarter is
    the recall's reserve) and keeps its KV; with the default scope (``all``) the turn's own
    evictions are candidates at once, so the same turn recalls some of them."""
    engine = make_engine(tiny_path, ENGINE)
    t = _turns(2)[:1]
    base = _chat(engine, "a", t, MethodSpec("snapkv", budget=18))  # the method's share of 24 (a quarter reserved)
    earlier = MethodSpec("snapkv+recall", budget=24, method_args={"recall_scope": "earlier"})
    var = _chat(engine, "b", t, earlier)
    assert var == base
    assert torch.equal(engine.manager.positions("a"), engine.manager.positions("b"))
    assert engine.controller.recall.cold_tokens("b") > 0  # what snapkv evicted is kept
    recalled = engine.controller.recall.recalled_tokens
    _chat(engine, "c", t, MethodSpec("snapkv+recall", budget=24))
    assert engine.controller.recall.recalled_tokens > recalled
    assert not torch.equal(engine.manager.positions("a"), engine.manager.positions("c"))


def test_with_a_reserve_a_recall_adds_to_the_method_s_tokens_and_never_displaces_them(tiny_path):
    """recall_reserve 0.25 (the default): the method keeps 18 of a 24 budget; every recall keeps
    each head's device tokens and adds cold ones up to the budget."""
    engine = make_engine(tiny_path, ENGINE)
    checked = []
    orig = engine.controller.recall_now

    def spy(seq_id, num_tokens, queries, at_input):
        before = engine.manager.positions(seq_id).clone()
        result = orig(seq_id, num_tokens, queries, at_input)
        after = engine.manager.positions(seq_id)
        for layer in range(before.shape[0]):
            for h in range(before.shape[1]):
                held = set(before[layer, h][before[layer, h] >= 0].tolist())
                now = set(after[layer, h][after[layer, h] >= 0].tolist())
                assert held <= now and len(now) <= max(24, len(held))
        checked.append(result.recalled)
        return result

    engine.controller.recall_now = spy
    _chat(engine, "s", _turns(3), MethodSpec("snapkv+recall", budget=24))
    assert checked and sum(checked) > 0 and engine.controller.recall.recalled_tokens > 0


def test_recall_pool_ranks_a_record_with_the_key_its_query_attends():
    """``_pooled``: a token's score is the best logit within ``recall_pool`` positions of it, in
    position order across held and candidate tokens; invalid slots neither lend nor keep a score."""
    logit = torch.tensor([[[0.0, 9.0, 1.0, 2.0, 3.0, 5.0]]])
    pos = torch.tensor([[[40, 10, 11, 12, 30, -1]]])  # held 40, 10..12, candidate 30, an empty slot
    valid = pos >= 0
    assert torch.equal(_pooled(logit, pos, valid, 1), logit)
    pooled = _pooled(logit, pos, valid, 3)
    # position order: 10 (9), 11 (1), 12 (2), 30 (3), 40 (0); each takes the best of its two
    # neighbours in that order (12: 11, 30), and the empty slot (5) lends nothing
    assert pooled[0, 0, :5].tolist() == [3.0, 9.0, 9.0, 3.0, 3.0]


def _exact_top(engine, sid, before: int) -> torch.Tensor:
    """Recomputed here: for each (layer, kv-head), the position before ``before`` with the highest
    max_q q.k among every token the session holds (device and cold), queries = the session's latest
    recorded ones (the turn's last input tokens)."""
    chain = engine.chains.chains[sid]
    q = chain.queries.q[:, : min(min(chain.queries.count), chain.queries.size)].float()  # [L, n, Hq, D]
    Lq, n, Hq, Dq = q.shape
    Hk = engine.manager.num_kv_heads
    q = q.reshape(Lq, n, Hk, Hq // Hk, Dq).permute(0, 2, 1, 3, 4).reshape(Lq, Hk, -1, Dq)
    store = engine.controller.recall.stores[sid]
    best = torch.empty(Lq, Hk, dtype=torch.int64)
    for layer in range(Lq):
        k, _, pos, _ = engine.manager.gather(sid, layer)
        for h in range(Hk):
            live = torch.arange(store.capacity) < store.count[layer, h]
            live &= ~store.dead[layer, h].repeat_interleave(store.P)[: store.capacity]
            ck = store.k[layer, h][live].float()
            cp = store.pos[layer, h][live]
            hk = k[h][pos[h] >= 0].float()
            hp = pos[h][pos[h] >= 0]
            allk, allp = torch.cat([hk, ck]), torch.cat([hp.to(torch.int32), cp])
            logit = (q[layer, h] @ allk.T).amax(0).masked_fill(allp >= before, float("-inf"))
            best[layer, h] = allp[logit.argmax()]
    return best


@pytest.mark.parametrize("reserve", [0.0, 0.5])
def test_a_token_evicted_in_turn_one_that_turn_three_needs_is_back_when_it_decodes(tiny_path, reserve):
    """Turn 1's tokens are evicted by streaming_llm (its window moves past them in turn 2); when turn
    3's input is in, the turn-1 token its queries attend most (recomputed here from every key the
    session holds), if an earlier turn evicted it, is on the device before turn 3's first token."""
    engine = make_engine(tiny_path, ENGINE)
    # every cold block a candidate: the bounds only shortlist blocks, the exact logits decide
    # (recall_pool=1: each token ranks by its own logit, as recomputed below; recall_reserve 0: the
    # recall competes with the whole unpinned budget, 0.5: it fills half the budget, never displacing)
    args = {"recall_pages": 64, "recall_window": 8, "recall_pool": 1, "recall_reserve": reserve}
    sid, spec = "n", MethodSpec("streaming_llm+recall", budget=48, method_args=args)
    turns = _turns(3)
    run_turn(engine, sid, turns[0], GREEDY, method=spec)
    run_turn(engine, sid, turns[1], GREEDY)
    cold = engine.controller.recall.cold_positions(sid)  # evicted in turns 1 and 2, not recalled since
    # turn 3: its input goes in, then one token (sampled after the recall)
    engine.add_turn(sid, turns[2], SamplingParams(max_tokens=1, ignore_eos=True))
    seen = {}
    orig = engine.controller.recall_now

    def spy(seq_id, num_tokens, queries, at_input):
        seen["top"] = _exact_top(engine, seq_id, before=len(turns[0]))  # turn 1's best token for turn 3
        seen["result"] = orig(seq_id, num_tokens, queries, at_input)
        seen["after"] = engine.manager.positions(seq_id).clone()
        return seen["result"]

    engine.controller.recall_now = spy
    while not any(o.finished for o in engine.step()):
        pass
    assert seen["result"].recalled > 0
    after = seen["after"]
    hits = 0
    for layer in range(after.shape[0]):
        for h in range(after.shape[1]):
            top = int(seen["top"][layer, h])
            if top in set(cold[layer][h].tolist()):  # turn 3's best token of turn 1 was cold before turn 3 ...
                assert top in set(after[layer, h].tolist())  # ... and is on the device when turn 3 decodes
                hits += 1
    assert hits > 0  # the rule was exercised: in some head that token was cold


@pytest.mark.parametrize("method", ["snapkv+recall", "streaming_llm+recall", "h2o+recall", "kvzip+recall"])
def test_device_tokens_per_head_never_exceed_the_budget(tiny_path, method):
    engine = make_engine(tiny_path, ENGINE)
    budget = 24
    spec = MethodSpec(method, budget=budget, method_args={"recall_interval": 2})
    cap = engine.controller.method_for(spec).kept_tokens(10**6)
    worst = []
    orig = engine.step

    def step():
        out = orig()
        if engine.manager.has("s") and engine.chains.chains["s"].seq.num_cached:
            worst.append(int(engine.manager.seq_lengths("s").max()))
        return out

    engine.step = step
    _chat(engine, "s", _turns(4), spec, SamplingParams(max_tokens=8, ignore_eos=True))
    assert engine.controller.recall.recalls > 0
    # at most the budget (+ the method's own slack) plus the token being decoded and the chunk in flight
    assert max(worst) <= cap + 64 + 1, (max(worst), cap)
    assert engine.manager.seq_lengths("s").max() <= cap + 8


def test_snapshot_with_a_cold_tier_resumes_with_the_same_tokens(tiny_path):
    spec = MethodSpec("snapkv+recall", budget=24, method_args={"cold_format": "fp8"})
    turns = _turns(5, (80, 30, 30, 30))
    a = make_engine(tiny_path, ENGINE)
    _chat(a, "s", turns[:2], spec)
    assert a.controller.recall.cold_tokens("s") > 0
    snap = a.snapshot_session("s")
    b = make_engine(tiny_path, ENGINE)
    b.load_session(snap)
    assert [run_turn(b, "s", t, GREEDY).token_ids for t in turns[2:]] == [
        run_turn(a, "s", t, GREEDY).token_ids for t in turns[2:]
    ]
    assert b.controller.recall.recalls > 0


def test_fork_copies_the_cold_tier(tiny_path):
    engine = make_engine(tiny_path, ENGINE)
    turns = _turns(6)
    _chat(engine, "p", turns[:2], MethodSpec("snapkv+recall", budget=24))
    engine.fork_session("p", "c")
    cold = engine.controller.recall.cold_tokens("p")
    assert engine.controller.recall.cold_tokens("c") == cold > 0
    assert run_turn(engine, "c", turns[2], GREEDY).token_ids == run_turn(engine, "p", turns[2], GREEDY).token_ids


def test_host_memory_bound_holds_and_drops_what_does_not_fit(tiny_path):
    engine = make_engine(tiny_path, ENGINE, recall_host_gb=4096 / 2**30)  # 4 KiB of cold tier
    limit = engine.controller.recall.host_limit
    peak = []
    orig = engine.controller.recall._append

    def append(*a):
        n = orig(*a)
        peak.append(engine.controller.recall.host_bytes)
        return n

    engine.controller.recall._append = append
    out = _chat(engine, "s", _turns(7), MethodSpec("snapkv+recall", budget=16))
    assert all(len(o) == GREEDY.max_tokens for o in out)  # the session goes on
    assert max(peak) <= limit
    assert engine.controller.recall.dropped_tokens > 0


@pytest.mark.parametrize(
    "name, args, match",
    [
        ("snapkv+recall", {"recall_interval": 0}, "recall_interval"),
        ("snapkv+recall", {"recall_interval": -3}, "recall_interval"),
        ("snapkv+recall", {"recall_interval": "0"}, "recall_interval"),
        ("snapkv+recall", {"recall_pages": -1}, "recall_pages"),
        ("snapkv+recall", {"recall_window": 0}, "recall_window"),
        ("snapkv+recall", {"recall_pool": 4}, "recall_pool"),
        ("snapkv+recall", {"recall_pool": 0}, "recall_pool"),
        ("snapkv+recall", {"recall_pool": 65}, "recall_pool"),
        ("snapkv+recall", {"recall_scope": "later"}, "recall_scope"),
        ("snapkv+recall", {"recall_score": "max"}, "recall_score"),
        ("snapkv+recall", {"recall_score": None}, "recall_score"),
        ("snapkv+recall", {"recall_reserve": 1.0}, "recall_reserve"),
        ("snapkv+recall", {"recall_reserve": float("nan")}, "recall_reserve"),
        ("snapkv+recall", {"recall_reserve": -0.1}, "recall_reserve"),
        ("snapkv+recall", {"cold_format": "int3"}, "cold_format"),
        ("snapkv+recall", {"recall_rerun": "maybe"}, "recall_rerun"),
        ("quest+recall", {}, "keeps every token"),
        ("kivi+recall", {}, "keeps every token|plain KV"),
        ("nonsense+recall", {}, "unknown method"),
    ],
)
def test_hostile_recall_settings_get_a_clear_error(tiny_path, name, args, match):
    engine = make_engine(tiny_path, ENGINE)
    with pytest.raises(MethodError, match=match):
        engine.add_turn("h", [5, 6, 7], GREEDY, method=MethodSpec(name, budget=16, method_args=args))
    assert "h" not in engine.chains.chains  # nothing was created


def test_budget_out_of_range_is_refused():
    with pytest.raises(MethodError):
        MethodSpec("snapkv+recall", budget=0)
    with pytest.raises(MethodError):
        MethodSpec("snapkv+recall", budget_ratio=float("nan"))
    assert get_method_class("snapkv+recall").name == "snapkv+recall"


def test_recall_score_mass_weighs_each_query_by_its_own_softmax():
    """``_score``: ``logit`` ranks by the best raw logit; ``mass`` by the attention weight summed over
    the queries, so a token that is one query's whole focus outranks one that only shares a larger
    but diffuse query's attention; an invalid slot takes no weight and scores 0."""
    q = torch.tensor([[[[10.0], [-10.0]]]])  # [L=1, H=1, Q=2, D=1]
    k = torch.tensor([[[[1.0], [0.9], [0.0], [5.0]]]])  # [1, 1, N=4, 1]; the last slot is empty
    valid = torch.tensor([[[True, True, True, False]]])
    assert _score(q, k, valid, "logit")[0, 0, :3].tolist() == [10.0, 9.0, 0.0]
    mass = _score(q, k, valid, "mass")[0, 0]
    expect = torch.tensor([[10.0, 9.0, 0.0], [-10.0, -9.0, 0.0]]).softmax(-1).sum(0)
    assert torch.allclose(mass[:3], expect) and mass[3] == 0
    assert mass[2] > mass[0] > mass[1]  # the second query's sole focus ranks first
