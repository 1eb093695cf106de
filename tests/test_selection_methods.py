"""Query-aware selection (quest, omnikv), offload (InfLLM-style host tier) and duo_attention.

Real SmolLM2 on the CPU, greedy; the rule checks use a real PagePool/CacheManager on small tensors.
"""

from __future__ import annotations

import json

import pytest
import torch

from engine.attention.reference import ReferenceAttention
from engine.cache.manager import CacheManager
from engine.cache.pages import PagePool
from engine.cache.view import AttentionView
from engine.lifecycle import DecodeBatch, ModelShape, PrefillChunk
from engine.method_spec import MethodError, MethodSpec
from engine.methods import REGISTRY, create_method
from engine.methods.quest import page_scores
from engine.sampling import SamplingParams
from tests.conftest import chat, haystack

NEW_METHODS = ("quest", "omnikv", "offload", "duo_attention")


@pytest.fixture(scope="module")
def prompt(smol_engine):
    return chat(smol_engine, haystack(12) + " What color is item 5?")  # ~135 tokens


def _run_together(eng, prompt, specs, max_tokens, check=None):
    """Run one request per spec in the same batches (mixed methods); token ids per spec, in order."""
    sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    ids = [eng.add_request(prompt, sp, method=spec) for spec in specs]
    done = {}
    while len(done) < len(ids):
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out.token_ids
        if check is not None:
            check(ids, done)
    return [done[i] for i in ids]


# --- 1. a selection that covers everything is dense ---------------------------------------------------
def test_covering_selection_equals_dense(smol_engine, prompt):
    specs = [MethodSpec("dense")] + [MethodSpec(m, budget=4096) for m in NEW_METHODS]
    dense, *others = _run_together(smol_engine, prompt, specs, 16)
    assert len(dense) == 16
    for method, tokens in zip(NEW_METHODS, others):
        assert tokens == dense, method


# --- 2. quest's rule on small tensors ----------------------------------------------------------------------
def test_quest_page_scores_are_the_formula():
    gen = torch.Generator().manual_seed(0)
    H, G, NP, D = 2, 3, 5, 8
    q = torch.randn(H * G, D, generator=gen)
    a, b = torch.randn(H, NP, D, generator=gen), torch.randn(H, NP, D, generator=gen)
    kmin, kmax = torch.minimum(a, b), torch.maximum(a, b)
    direct = torch.empty(H, NP)
    for h in range(H):
        for p in range(NP):
            per_query = [
                sum(
                    max(float(q[h * G + g, d] * kmax[h, p, d]), float(q[h * G + g, d] * kmin[h, p, d]))
                    for d in range(D)
                )
                for g in range(G)
            ]
            direct[h, p] = max(per_query)
    assert torch.allclose(page_scores(q, kmin, kmax), direct, atol=1e-5)


def _small_cache(H=2, D=8, P=4, n=37, seed=0, device="cpu"):
    pool = PagePool(256, P, D, torch.float32, device)
    mgr = CacheManager(pool, num_layers=1, num_kv_heads=H, max_seqs=2, max_len=256)
    gen = torch.Generator().manual_seed(seed)
    k, v = torch.randn(n, H, D, generator=gen), torch.randn(n, H, D, generator=gen)
    mgr.open("s")
    slots = mgr.append(["s"], [n], torch.arange(n))
    ReferenceAttention().store_kv(pool, slots[0], k.to(device), v.to(device))
    return pool, mgr, k, v, gen


def test_quest_selects_the_top_pages_and_attends_only_them():
    H, Hq, D, P = 2, 4, 8, 4
    pool, mgr, k, v, gen = _small_cache(H=H, D=D, P=P, n=33)
    shape = ModelShape(num_layers=1, num_heads=Hq, num_kv_heads=H, head_dim=D, page_size=P)
    quest = create_method(MethodSpec("quest", budget=4 * P, method_args={"dense_layers": 0}), shape)
    # prefill the first 33 tokens' summaries, then decode 3 tokens (pages fill incrementally)
    quest.after_prefill_chunk(
        0,
        PrefillChunk(
            seq_id="s",
            layer=0,
            start=0,
            length=33,
            is_last=True,
            q=None,
            k=k,
            v=v,
            lengths=mgr.lengths[0, 0].clone(),
            cache=mgr,
        ),
    )
    for step in range(3):
        kn, vn = torch.randn(1, H, D, generator=gen), torch.randn(1, H, D, generator=gen)
        n = 33 + step + 1
        slots = mgr.append(["s"], [1], torch.tensor([n - 1]))
        ReferenceAttention().store_kv(pool, slots[0], kn, vn)
        k, v = torch.cat([k, kn]), torch.cat([v, vn])
        q = torch.randn(1, Hq, D, generator=gen)
        batch = DecodeBatch(layer=0, seq_ids=["s"], num_tokens=[n], q=q, lengths=mgr.lengths[[0], 0], cache=mgr, k=kn)
        sel = quest.decode_view(0, batch).selected_pages[0]  # [H, K]

        NP = -(-n // P)
        for h in range(H):
            pages = k[:, h].new_full((NP * P, D), float("nan"))
            pages[:n] = k[:, h]
            pages = pages.view(NP, P, D)
            kmax = torch.stack([pg[~pg.isnan().any(-1)].amax(0) for pg in pages])
            kmin = torch.stack([pg[~pg.isnan().any(-1)].amin(0) for pg in pages])
            qg = q[0, h * 2 : h * 2 + 2]
            score = torch.maximum(qg[:, None, :] * kmax, qg[:, None, :] * kmin).sum(-1).amax(0)  # [NP]
            middle = list(range(1, NP - 1))  # page 0 is the sink, the last page the recent one
            best = sorted(middle, key=lambda p: -float(score[p]))[:2]
            assert sorted(sel[h][sel[h] >= 0].tolist()) == sorted([0, NP - 1] + best)

        # attention over the selection equals dense attention over the selected pages' tokens only
        tables, lengths = mgr.view_tables(torch.tensor([0]), 0, NP)
        view = AttentionView(tables, lengths, P, selected_pages=sel[None])
        out, _ = ReferenceAttention().decode(pool, view, q, D**-0.5)
        for h in range(H):
            toks = torch.cat([torch.arange(p * P, min((p + 1) * P, n)) for p in sel[h].tolist() if p >= 0])
            for g in range(2):
                w = torch.softmax(k[toks, h] @ q[0, h * 2 + g] * D**-0.5, 0)
                assert torch.allclose(out[0, h * 2 + g], w @ v[toks, h], atol=1e-5)


def _page_bounds_direct(mgr, seq_id, layer=0):
    """Every page's key min/max from the cache's physical keys, ``[H, NP, D]`` each (the rule)."""
    k, _, _, lengths = mgr.gather(seq_id, layer)
    k, lengths = k.cpu(), lengths.cpu()
    H, T, D = k.shape
    P = mgr.page_size
    NP = -(-T // P)
    lo, hi = torch.full((H, NP, D), float("inf")), torch.full((H, NP, D), float("-inf"))
    for h in range(H):
        for p in range(-(-int(lengths[h]) // P)):
            keys = k[h, p * P : min((p + 1) * P, int(lengths[h]))]
            lo[h, p], hi[h, p] = keys.amin(0), keys.amax(0)
    return lo, hi


def _stored_bounds(quest, mgr, seq_id, layer=0):
    ids, lengths = mgr.page_table(seq_id, layer)
    lo, hi = quest.bounds(mgr).gather(ids[None])
    return lo[0].cpu(), hi[0].cpu(), ids


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"))]


@pytest.mark.parametrize("device", DEVICES)
def test_quest_bounds_rebuild_when_the_cache_changes_under_them(device):
    H, D, P = 2, 8, 4
    pool, mgr, k, v, gen = _small_cache(H=H, D=D, P=P, n=21, device=device)
    shape = ModelShape(num_layers=1, num_heads=H, num_kv_heads=H, head_dim=D, page_size=P)
    quest = create_method(MethodSpec("quest", budget=8, method_args={"dense_layers": 0}), shape)

    def decode_one(seq="s"):
        slot = mgr.slot(seq)
        kn, vn = torch.randn(1, H, D, generator=gen).to(device), torch.randn(1, H, D, generator=gen).to(device)
        slots = mgr.append([seq], [1], torch.tensor([int(mgr.lengths[slot, 0].max())]))
        ReferenceAttention().store_kv(pool, slots[0], kn, vn)
        batch = DecodeBatch(
            layer=0,
            seq_ids=[seq],
            num_tokens=[int(mgr.lengths[slot, 0].max())],
            q=torch.randn(1, H, D, generator=gen).to(device),
            lengths=mgr.lengths[[slot], 0],
            cache=mgr,
            k=kn,
        )
        quest.decode_view(0, batch)
        lo, hi, ids = _stored_bounds(quest, mgr, seq)
        want_lo, want_hi = _page_bounds_direct(mgr, seq)
        inside = torch.isfinite(want_lo[..., 0])
        assert torch.equal(lo[inside], want_lo[inside]) and torch.equal(hi[inside], want_hi[inside])

    # no prefill bounds at all (a resumed session): the first decode builds them from the cache
    decode_one()
    # eviction compacts the heads (pruning, rollback): pages are rewritten in place, bounds follow
    mgr.evict("s", 0, [torch.tensor([0, 2, 3, 9, 10, 11, 12, 20, 21]), torch.arange(5, 22)])
    decode_one()
    decode_one()
    # a fork shares the pages (its partly filled page is copied on write), then both go on
    mgr.fork("s", "t")
    decode_one("t")
    decode_one("s")
    # a snapshot restored into fresh pages (which held other keys before)
    snap = mgr.snapshot("t")
    mgr.release("t")
    mgr.release("s")
    mgr.restore("u", snap)
    decode_one("u")
    quest.release("u")


@pytest.mark.parametrize("device", DEVICES)
def test_quest_batched_selection_equals_the_rule_per_sequence(device):
    """Several sequences of different lengths in one decode batch (one of them starting a new page,
    one prefilled in two chunks): each row's pages are those the rule picks for it alone."""
    H, Hq, D, P = 2, 4, 8, 4
    pool = PagePool(256, P, D, torch.float32, device)
    mgr = CacheManager(pool, num_layers=2, num_kv_heads=H, max_seqs=4, max_len=128)
    shape = ModelShape(num_layers=2, num_heads=Hq, num_kv_heads=H, head_dim=D, page_size=P)
    budget_pages = 4
    quest = create_method(MethodSpec("quest", budget=budget_pages * P, method_args={"dense_layers": 1}), shape)
    gen = torch.Generator().manual_seed(3)
    seqs = {"a": 22, "b": 32, "c": 9}  # b's next token starts page 8; c has fewer pages than the budget
    for name, n in seqs.items():
        mgr.open(name)
        chunks = [n] if name != "a" else [13, n - 13]
        done = 0
        for m in chunks:
            slots = mgr.append([name], [m], torch.arange(done, done + m))
            k, v = torch.randn(m, H, D, generator=gen).to(device), torch.randn(m, H, D, generator=gen).to(device)
            for layer in range(2):
                ReferenceAttention().store_kv(pool, slots[layer], k, v)
                quest.after_prefill_chunk(
                    layer,
                    PrefillChunk(
                        seq_id=name,
                        layer=layer,
                        start=done,
                        length=m,
                        is_last=m == chunks[-1],
                        q=None,
                        k=k,
                        v=v,
                        lengths=mgr.lengths[mgr.slot(name), layer].clone(),
                        cache=mgr,
                    ),
                )
            done += m
    names = list(seqs)
    slot_ids = torch.tensor([mgr.slot(s) for s in names])
    for step in range(3):
        slots = mgr.append(names, [1] * len(names), torch.tensor([seqs[s] + step for s in names]))
        kn = torch.randn(len(names), H, D, generator=gen).to(device)
        ReferenceAttention().store_kv(pool, slots[1], kn, torch.randn(len(names), H, D, generator=gen).to(device))
        q = torch.randn(len(names), Hq, D, generator=gen)
        lengths = mgr.lengths[slot_ids, 1]
        NP = -(-int(lengths.max()) // P)
        tables, dev_lengths = mgr.view_tables(slot_ids.to(device), 1, NP)
        batch = DecodeBatch(
            layer=1,
            seq_ids=names,
            num_tokens=[seqs[s] + step + 1 for s in names],
            q=q.to(device),
            lengths=lengths,
            cache=mgr,
            k=kn,
            tables=tables,
            device_lengths=dev_lengths,
        )
        assert quest.decode_view(0, batch) is None  # a dense layer
        sel = quest.decode_view(1, batch).selected_pages.cpu()
        # the CUDA-graph form reads the cache's full-width tables and must pick the same pages
        assert quest.graph_decode()
        rows = slot_ids.to(device)
        in_graph = quest.graph_decode_view(
            1, mgr, q.to(device), mgr.tables_dev[rows, 1], mgr.lengths_dev[rows, 1]
        ).cpu()
        assert in_graph.shape[-1] == budget_pages
        for i in range(len(names)):
            for h in range(H):
                row = in_graph[i, h]
                assert (row >= 0).sum() == (sel[i, h] >= 0).sum() and bool((row[row >= 0].diff() > 0).all())
                assert sorted(row[row >= 0].tolist()) == sorted(sel[i, h][sel[i, h] >= 0].tolist())
        for i, name in enumerate(names):
            lo, hi = _page_bounds_direct(mgr, name, layer=1)
            n_pages = lo.shape[1]
            score = page_scores(q[i], lo, hi)  # [H, n_pages]
            for h in range(H):
                middle = sorted(range(1, n_pages - 1), key=lambda p: -float(score[h, p]))
                want = sorted({0, n_pages - 1, *middle[: budget_pages - 2]})
                assert sorted(sel[i, h][sel[i, h] >= 0].tolist()) == want, (name, step, h)


# --- 3. offload: GPU pages bounded, the host holds the rest, nothing lost ----------------------------------
def test_offload_keeps_device_pages_within_budget(smol_engine, prompt):
    eng = smol_engine
    L, H, P = eng.shape.num_layers, eng.shape.num_kv_heads, eng.shape.page_size
    args = {"n_sink": 16, "n_local": 16}
    spec = MethodSpec("offload", budget=3 * P, method_args=args)
    # the same selection without the host tier, in the same batches: the host round trip must be lossless
    twin = MethodSpec("offload", budget=3 * P, method_args={**args, "use_host": False})
    per_head = create_method(spec, eng.shape).layout(len(prompt))[2] + 1  # read set + the page being written
    base = eng.pool.num_used
    seen = []

    def check(ids, done):
        rid, other = ids
        if rid in done or not eng._seqs[rid].in_decode or eng._seqs[rid].num_cached <= len(prompt):
            return
        device_pages = eng.manager.num_pages(rid)
        cold = sum(eng.manager.num_host_pages(rid, layer) for layer in range(L))
        lengths = eng.manager.seq_lengths(rid)
        assert eng.pool.num_used - base == device_pages + eng.manager.num_pages(other)  # the pool's counter agrees
        assert device_pages <= L * H * per_head
        assert cold > 0 and eng.pool.host.num_used >= cold
        assert device_pages + cold == int(((lengths + P - 1) // P).sum())  # every page is on one tier or both
        assert eng.manager.num_pages(other) == int(((lengths + P - 1) // P).sum())  # the twin keeps all on the device
        seen.append(device_pages)

    tokens, same = _run_together(eng, prompt, [spec, twin], 20, check)
    assert len(seen) >= 16
    assert eng.pool.num_used == base and eng.pool.host.num_used == 0  # all freed at the end
    assert tokens == same


def test_offloaded_session_snapshots_and_continues(smol_engine, prompt):
    eng = smol_engine
    P = eng.shape.page_size
    sp = SamplingParams(max_tokens=4, ignore_eos=True)
    outs = {}
    for sid, use_host in (("off-host", True), ("off-dev", False)):
        spec = MethodSpec("offload", budget=3 * P, method_args={"n_sink": 16, "n_local": 16, "use_host": use_host})
        eng.add_turn(sid, prompt, sp, method=spec)
    while eng.has_unfinished():
        eng.step()
    for sid in ("off-host", "off-dev"):
        outs[sid] = [eng.snapshot_session(sid).kv]
    assert sum(eng.manager.num_host_pages("off-host", layer) for layer in range(eng.shape.num_layers)) > 0
    a, b = outs["off-host"][0], outs["off-dev"][0]
    assert (
        torch.equal(a.lengths, b.lengths)
        and torch.equal(a.k, b.k)
        and torch.equal(a.v, b.v)
        and torch.equal(a.pos, b.pos)
    )
    # the next turn prefills over the offloaded history (cold pages come back) and decodes the same
    second = chat(eng, "And item 7?")
    for sid in outs:
        eng.add_turn(sid, second, sp)
    done = {}
    while len(done) < 2:
        done.update({o.request_id: o.token_ids for o in eng.step() if o.finished})
    for sid in outs:
        outs[sid].append(done[sid])
        eng.end_session(sid)
    assert outs["off-host"][1] == outs["off-dev"][1]


# --- duo_attention -------------------------------------------------------------------------------------------
def test_duo_attention_streaming_heads_free_memory(smol_engine, prompt):
    eng = smol_engine
    spec = MethodSpec("duo_attention", budget=64, method_args={"sparsity": 0.5})
    method = eng.controller.method_for(spec)
    assert int(method.streaming.sum()) == round(0.5 * method.streaming.numel())
    rid = eng.add_request(prompt, SamplingParams(max_tokens=4, ignore_eos=True), method=spec)
    checked = False
    while eng.has_unfinished():
        eng.step()
        if eng.manager.has(rid) and eng._seqs[rid].in_decode:
            lengths = eng.manager.seq_lengths(rid)
            assert int(lengths[method.streaming].max()) <= 64
            assert bool((lengths[~method.streaming] == eng._seqs[rid].num_cached).all())
            checked = True
    assert checked


def test_duo_calibration_writes_a_pattern_the_method_loads(smol_engine, tmp_path):
    from engine.methods.duo_calibration import calibrate, write_pattern

    pattern = calibrate(smol_engine, samples=1, min_tokens=160, max_tokens=160, n_sink=8, n_recent=16)
    scores = torch.tensor(pattern["scores"])
    assert scores.shape == (smol_engine.shape.num_layers, smol_engine.shape.num_kv_heads)
    assert bool(((scores >= 0) & (scores <= 1)).all()) and float(scores.std()) > 0
    path = write_pattern(pattern, tmp_path / "p.json")
    method = create_method(
        MethodSpec("duo_attention", method_args={"pattern": str(path), "sparsity": 0.25}), smol_engine.shape
    )
    assert torch.allclose(method.scores, scores)
    # the streaming heads are the quarter with the lowest scores
    assert float(scores[method.streaming].max()) <= float(scores[~method.streaming].min())
    with pytest.raises(MethodError, match="is for"):
        bad = dict(pattern, num_layers=2)
        (tmp_path / "bad.json").write_text(json.dumps(bad))
        create_method(
            MethodSpec("duo_attention", method_args={"pattern": str(tmp_path / "bad.json")}), smol_engine.shape
        )


def test_shipped_smollm2_pattern(smol_engine):
    method = create_method(MethodSpec("duo_attention"), smol_engine.shape)  # pattern=auto
    assert method.scores.shape == (smol_engine.shape.num_layers, smol_engine.shape.num_kv_heads)


# --- 4. CLI, --help and the sidecar's request fields -------------------------------------------------------------
@pytest.mark.slow  # generates with SmolLM2
def test_methods_in_help_and_cli(capsys):
    from sidecar.cli.main import build_parser, main

    text = build_parser()._subparsers._group_actions[0].choices["generate"].format_help()
    for name in NEW_METHODS:
        assert name in text and name in REGISTRY
    assert (
        main(
            [
                "generate",
                "--method",
                "quest",
                "--budget",
                "256",
                "--method-arg",
                "dense_layers=1",
                "--num-pages",
                "3000",
                "--max-tokens",
                "4",
                "--ignore-eos",
                "--json",
                "Hello there",
            ]
        )
        == 0
    )
    out = json.loads(capsys.readouterr().out)
    assert out["method"] == "quest" and len(out["token_ids"]) == 4


def test_sidecar_request_fields_build_each_method(smol_engine):
    from sidecar._proto.chainkv.v1 import sidecar_pb2 as pb
    from sidecar.turns.protocol import InvalidRequest, method_spec
    from sidecar.turns.request import from_proto

    cases = {
        "quest": {"dense_layers": "1"},
        "omnikv": {"filter_layers": "2,8"},
        "offload": {"n_sink": "32"},
        "duo_attention": {"sparsity": "0.25"},
    }
    for name, args in cases.items():
        spec = method_spec(from_proto(pb.TurnRequest(method=name, budget=256, method_args=args)))
        m = smol_engine.controller.method_for(spec)
        assert m.name == name and m.spec.budget == 256
    assert smol_engine.controller.method_for(
        method_spec(from_proto(pb.TurnRequest(method="omnikv", budget_ratio=0.1, method_args={"filter_layers": "2,8"})))
    ).filters == [2, 8]
    with pytest.raises(InvalidRequest):
        method_spec(from_proto(pb.TurnRequest(method="quest", budget=256, method_args={"page": "8"})))


# --- the other rules on small tensors ------------------------------------------------------------------------
def test_omnikv_filter_layer_choice_is_reused_by_the_next_layers():
    H, Hq, D, P, n = 2, 4, 8, 4, 30
    pool, mgr, k, v, gen = _small_cache(H=H, D=D, P=P, n=n)
    shape = ModelShape(num_layers=6, num_heads=Hq, num_kv_heads=H, head_dim=D, page_size=P)
    m = create_method(MethodSpec("omnikv", budget=7, method_args={"filter_layers": "1,4"}), shape)
    assert [m.needs_decode_probs_at(layer) for layer in range(6)] == [False, True, False, False, True, False]
    lengths = torch.full((1, H), n, dtype=torch.int32)
    probs = torch.softmax(torch.randn(1, Hq, n, generator=gen), -1)
    batch = DecodeBatch(
        layer=1, seq_ids=["s"], num_tokens=[n], q=torch.zeros(1, Hq, D), lengths=lengths, cache=mgr, probs=probs
    )
    assert m.decode_view(0, batch) is None and m.decode_view(1, batch) is None  # before / at the filter layer: dense
    m.after_decode(1, batch)
    score = probs[0].sum(0)
    score[n - 1] = float("inf")
    expect = torch.zeros(n, dtype=torch.bool)
    expect[score.topk(7).indices] = True
    for layer in (2, 3):
        mask = m.decode_view(layer, batch).token_mask
        assert mask.shape == (1, H, n) and bool((mask[0] == expect).all())
    assert m.decode_view(4, batch) is None


def test_offload_selects_blocks_by_their_mean_key():
    H, Hq, D, P, n = 2, 4, 8, 4, 40
    pool, mgr, k, v, gen = _small_cache(H=H, D=D, P=P, n=n)
    shape = ModelShape(num_layers=1, num_heads=Hq, num_kv_heads=H, head_dim=D, page_size=P)
    m = create_method(MethodSpec("offload", budget=5 * P, method_args={"n_sink": 4, "n_local": 4}), shape)
    sink, local, total = m.layout(n)
    assert (sink, local, total) == (1, 1, 5)
    q = torch.randn(1, Hq, D, generator=gen)
    batch = DecodeBatch(layer=0, seq_ids=["s"], num_tokens=[n], q=q, lengths=mgr.lengths[[0], 0], cache=mgr)
    sel = m.decode_view(0, batch)
    NP = n // P
    for h in range(H):
        mean = k[:, h].view(NP, P, D).mean(1)
        score = (q[0, 2 * h : 2 * h + 2] @ mean.T).amax(0)
        best = sorted(range(1, NP - 1), key=lambda p: -float(score[p]))[:3]
        chosen = sel.selected_pages[0, h][sel.selected_pages[0, h] >= 0].tolist()
        assert chosen == sorted([0, NP - 1] + best)
        cold = sel.to_host[0, h][sel.to_host[0, h] >= 0].tolist()
        assert sorted(cold) == sorted(set(range(NP)) - set(chosen))
