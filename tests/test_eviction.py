"""The eviction family (h2o, tova, snapkv, pyramidkv, adakv, keydiff, ...): full budget equals dense,
each paper's rule recomputed here in plain torch picks exactly the tokens the engine keeps, evicted
pages really go back to the pool, and the CLI runs them."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from engine.method_spec import MethodSpec
from engine.methods import REGISTRY
from engine.methods.pyramidkv import pyramid_budgets
from engine.model.llama import rope_tables
from engine.sampling import SamplingParams

from tests.conftest import chat, haystack, make_engine

EVICTION = sorted(n for n in REGISTRY if n not in ("dense",) and getattr(REGISTRY[n], "needs_budget", False))


# --- 1. a budget that holds the whole context changes nothing -------------------------------------
def test_full_budget_equals_dense(smol_engine):
    prompt = chat(smol_engine, haystack(6) + " What color is item 3?")
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    budget = len(prompt) + params.max_tokens  # the whole context, prompt and reply, and not one token more
    ids = {"dense": smol_engine.add_request(prompt, params)}
    for name in EVICTION:
        ids[name] = smol_engine.add_request(prompt, params, method=MethodSpec(name, budget=budget))
    evicted = smol_engine.controller.evicted_tokens
    outs = {}
    while len(outs) < len(ids):
        for o in smol_engine.step():
            if o.finished:
                outs[o.request_id] = o.token_ids
    dense = outs[ids["dense"]]
    assert len(dense) == params.max_tokens
    for name in EVICTION:
        assert outs[ids[name]] == dense, name
    assert smol_engine.controller.evicted_tokens == evicted


# --- 2. each paper's rule, computed directly, picks the kept tokens -------------------------------
N, B = 48, 16  # prompt tokens, budget per head


@pytest.fixture(scope="module")
def tiny_engine(tiny_models):
    path, _ = tiny_models("llama")  # 3 layers, 4 query heads, 2 kv-heads, head_dim 16
    return make_engine(path, device="cpu", num_pages=4000, page_size=4, prefill_chunk_size=256)


def _spy(engine, spec):
    """Record, at each hook, the q the method saw and the whole cache before its decision."""
    m = engine.controller.method_for(spec)
    seen = {"prefill": {}, "decode": {}, "chunks": {}}
    orig_prefill, orig_decode = m.after_prefill_chunk, m.after_decode

    def after_prefill_chunk(layer, chunk):
        k, v, pos, _ = chunk.cache.gather(chunk.seq_id, layer)
        seen["prefill"][layer] = dict(
            q=chunk.q.clone(),
            qpos=torch.arange(chunk.start, chunk.num_tokens),
            k=k.clone(),
            v=v.clone(),
            pos=pos.clone(),
        )
        seen["chunks"].setdefault(layer, []).append(seen["prefill"][layer])
        return orig_prefill(layer, chunk)

    def after_decode(layer, batch):
        k, v, pos, _ = batch.cache.gather(batch.seq_ids[0], layer)
        seen["decode"].setdefault(layer, []).append(
            dict(
                q=batch.q[:1].clone(),
                qpos=torch.tensor([batch.num_tokens[0] - 1]),
                k=k.clone(),
                v=v.clone(),
                pos=pos.clone(),
            )
        )
        return orig_decode(layer, batch)

    m.after_prefill_chunk, m.after_decode = after_prefill_chunk, after_decode
    return seen


def _run(engine, spec, steps: int):
    seen = _spy(engine, spec)
    prompt = torch.randint(0, 320, (N,), generator=torch.Generator().manual_seed(7)).tolist()
    rid = engine.add_request(prompt, SamplingParams(max_tokens=steps + 1, ignore_eos=True), method=spec)
    for _ in range(steps):
        engine.step()
    kept = []
    for layer in range(engine.shape.num_layers):
        pos = engine.manager.gather(rid, layer)[2]
        kept.append([sorted(int(p) for p in row if p >= 0) for row in pos])
    engine.abort(rid)
    while engine.has_unfinished():
        engine.step()
    return seen, kept


def probs_of(rec) -> torch.Tensor:
    """softmax(q k^T / sqrt(d)), causal by position, GQA: ``[Hq, n, T]``."""
    q, k, qpos, kpos = rec["q"].float(), rec["k"].float(), rec["qpos"], rec["pos"]
    G = q.shape[1] // k.shape[0]
    kk = k.repeat_interleave(G, 0)
    s = torch.einsum("nhd,htd->hnt", q, kk) / math.sqrt(q.shape[-1])
    kp = kpos.repeat_interleave(G, 0)[:, None, :]
    s = s.masked_fill((kp < 0) | (kp > qpos[None, :, None]), float("-inf"))
    return torch.softmax(s, -1)


def top(scores: torch.Tensor, k: int) -> list[int]:
    return sorted(scores.topk(k).indices.tolist())


def snap(rec, w, kernel) -> torch.Tensor:
    """SnapKV: window-summed attention, avg-pooled, GQA-mean, over the prefix ``[H, n - w]``."""
    p = probs_of(rec)[:, -w:, : N - w].sum(1)
    p = F.avg_pool1d(p[:, None], kernel, stride=1, padding=kernel // 2)[:, 0]
    return p.reshape(rec["k"].shape[0], -1, N - w).mean(1)


def test_snapkv_rule(tiny_engine):
    w, kernel = 4, 3
    seen, kept = _run(
        tiny_engine, MethodSpec("snapkv", budget=B, method_args={"window_size": w, "kernel_size": kernel}), 1
    )
    for layer, rec in seen["prefill"].items():
        s = snap(rec, w, kernel)
        for h in range(2):
            assert kept[layer][h] == top(s[h], B - w) + list(range(N - w, N)), (layer, h)


def test_snapkv_window_spans_prefill_chunks(tiny_models):
    """Chunks of 20, 20 and 8 tokens: the 12-token window reaches back into the second chunk."""
    engine = make_engine(tiny_models("llama")[0], device="cpu", num_pages=4000, page_size=4, prefill_chunk_size=20)
    w, kernel = 12, 3
    seen, kept = _run(
        engine, MethodSpec("snapkv", budget=B + 8, method_args={"window_size": w, "kernel_size": kernel}), 3
    )
    for layer, chunks in seen["chunks"].items():
        assert [len(c["q"]) for c in chunks] == [20, 20, 8]
        rec = dict(chunks[-1], q=torch.cat([c["q"] for c in chunks]), qpos=torch.arange(N))
        s = snap(rec, w, kernel)
        for h in range(2):
            assert kept[layer][h] == top(s[h], B + 8 - w) + list(range(N - w, N)), (layer, h)


def test_pyramidkv_rule(tiny_engine):
    w, kernel, beta = 4, 3, 2
    seen, kept = _run(
        tiny_engine,
        MethodSpec("pyramidkv", budget=B, method_args={"window_size": w, "kernel_size": kernel, "beta": beta}),
        1,
    )
    # kvpress' PyramidKVPress: top layer B/beta, bottom 2B - B/beta, linear in between, window included
    lo, hi = B / beta, 2 * B - B / beta
    budgets = [round(hi - (hi - lo) * layer / 2) for layer in range(3)]
    assert budgets == [24, 16, 8] and sum(budgets) == 3 * B
    for layer, rec in seen["prefill"].items():
        s = snap(rec, w, kernel)
        for h in range(2):
            assert kept[layer][h] == top(s[h], budgets[layer] - w) + list(range(N - w, N)), (layer, h)
            assert len(kept[layer][h]) == budgets[layer]


def test_pyramidkv_budgets_follow_kvpress():
    """kvpress' PyramidKVPress: the window is in the line, the bottom layer is capped at
    context - window, and a top layer under the window falls back to snapkv's uniform budget."""
    assert pyramid_budgets(3, 16, 4, 48, 2) == [24, 16, 8]
    assert pyramid_budgets(4, 48, 8, 1000, 20) == [48] * 4  # 48 / 20 < 8: snapkv
    assert pyramid_budgets(3, 40, 4, 60, 2) == [56, 40, 24]  # 2*40 - 20 = 60 >= 60 - 4: capped at 56, top 80 - 56
    assert pyramid_budgets(3, 102.4, 4, 256, 4) == [179, 102, 26]  # a ratio's unrounded budget, Python rounding
    b = pyramid_budgets(30, 2048, 64, 8000, 20)
    assert b[0] == 3994 and b[-1] == 102 and sum(b) == 30 * 2048


def test_adakv_rule(tiny_engine):
    spec = MethodSpec("adakv", budget=B, method_args={"alpha_safeguard": 0.25})
    inner = tiny_engine.controller.method_for(spec).scorer
    inner.params.window_size, inner.params.kernel_size = 4, 3  # the scorer's parameters for this test
    seen, kept = _run(tiny_engine, spec, 1)
    w, kernel, floor = 4, 3, 4
    uneven = False
    for layer, rec in seen["prefill"].items():
        s = torch.cat([snap(rec, w, kernel), torch.zeros(2, w)], 1)
        s[:, N - w :] = 1e9  # the window is always kept
        for h in range(2):
            s[h, s[h].topk(floor).indices] = 1e9  # the per-head safeguard
        flat = s.reshape(-1).topk(2 * B).indices
        for h in range(2):
            assert kept[layer][h] == sorted((flat[flat // N == h] % N).tolist()), (layer, h)
        assert len(kept[layer][0]) + len(kept[layer][1]) == 2 * B
        uneven |= len(kept[layer][0]) != B
    assert uneven  # heads really got different budgets


def test_tova_rule_prefill_and_decode(tiny_engine):
    seen, kept = _run(tiny_engine, MethodSpec("tova", budget=B), 1)
    for layer, rec in seen["prefill"].items():
        s = probs_of(rec)[:, -1].mean(0)  # last query, averaged over all heads of the layer
        assert kept[layer] == [top(s, B)] * 2
    seen, kept = _run(tiny_engine, MethodSpec("tova", budget=N), 2)  # the first decode step drops one
    for layer, recs in seen["decode"].items():
        s = probs_of(recs[-1])[:, 0].mean(0)
        assert kept[layer] == [top(s, N)] * 2


def test_h2o_rule_prefill_and_decode(tiny_engine):
    seen, kept = _run(tiny_engine, MethodSpec("h2o", budget=B), 1)
    recent = B // 2
    for layer, rec in seen["prefill"].items():
        acc = probs_of(rec).sum(1).reshape(2, 2, N).sum(1)  # every prompt query, summed over the GQA group
        for h in range(2):
            assert kept[layer][h] == top(acc[h, : N - recent], B - recent) + list(range(N - recent, N))
    seen, kept = _run(tiny_engine, MethodSpec("h2o", budget=N), 2)
    recent = N // 2
    for layer in seen["decode"]:
        pre, dec = seen["prefill"][layer], seen["decode"][layer][-1]
        acc = F.pad(probs_of(pre).sum(1), (0, 1)) + probs_of(dec)[:, 0]
        acc = acc.reshape(2, 2, N + 1).sum(1)
        for h in range(2):
            assert kept[layer][h] == top(acc[h, : N + 1 - recent], N - recent) + list(range(N + 1 - recent, N + 1))


def test_keydiff_rule(tiny_engine):
    seen, kept = _run(tiny_engine, MethodSpec("keydiff", budget=B), 1)
    for layer, rec in seen["prefill"].items():
        k = rec["k"].float()
        anchor = F.normalize(k, dim=-1).mean(1, keepdim=True)
        s = -F.cosine_similarity(k, anchor, dim=-1)
        for h in range(2):
            assert kept[layer][h] == top(s[h], B)


@pytest.fixture(scope="module")
def short_engine(tiny_models):
    """The tiny model with max_model_len just above the prompt: its RoPE tables end before the
    future positions expected_attention averages over."""
    path, _ = tiny_models("llama")
    return make_engine(path, device="cpu", num_pages=4000, page_size=4, prefill_chunk_size=256, max_model_len=N + 8)


@pytest.mark.parametrize("engine_name", ["tiny_engine", "short_engine"])
def test_expected_attention_rule(engine_name, request):
    n_future, n_sink = 16, 2
    engine = request.getfixturevalue(engine_name)
    seen, kept = _run(
        engine,
        MethodSpec("expected_attention", budget=B, method_args={"n_future_positions": n_future, "n_sink": n_sink}),
        1,
    )
    # the rotation of positions N .. N + n_future, also those past max_model_len (the engine's tables)
    D = engine.model.rope_cos.shape[-1]
    cos, sin = rope_tables(engine.hf_config, D, N + n_future)

    def rope(x, p):  # rotate-half RoPE of row vectors x [.., D] at position p
        return x * cos[p] + torch.cat([-x[..., D // 2 :], x[..., : D // 2]], -1) * sin[p]

    # the average rotation over the next n_future positions, built from RoPE applied to a basis
    R = torch.stack([rope(torch.eye(D), p).T for p in range(N, N + n_future)]).mean(0)
    for layer, rec in seen["prefill"].items():
        q = rec["q"].float()[n_sink:]  # [n, Hq, D] after RoPE
        # undo RoPE: the inverse rotation is RoPE at the negative angle (cos, -sin)
        pre = torch.stack(
            [
                q[i] * cos[n_sink + i] - torch.cat([-q[i, :, D // 2 :], q[i, :, : D // 2]], -1) * sin[n_sink + i]
                for i in range(q.shape[0])
            ]
        )
        assert torch.allclose(torch.stack([rope(pre[i], n_sink + i) for i in range(q.shape[0])]), q, atol=1e-5)
        mu = pre.mean(0)  # [Hq, D]
        cov = torch.einsum("nhd,nhe->hde", pre - mu, pre - mu) / pre.shape[0]
        mu, cov = mu @ R.T, R @ cov @ R.T
        k, v = rec["k"].float().repeat_interleave(2, 0), rec["v"].float()
        logit = torch.einsum("htd,hd->ht", k, mu) / math.sqrt(D) + torch.einsum("htd,hde,hte->ht", k, cov, k) / (2 * D)
        s = torch.softmax(logit[:, n_sink:], -1).reshape(2, 2, -1).mean(1) * v[:, n_sink:].norm(dim=-1)
        for h in range(2):
            assert kept[layer][h] == list(range(n_sink)) + [n_sink + i for i in top(s[h], B - n_sink)], (layer, h)


def test_rkv_rule(tiny_engine):
    seen, kept = _run(tiny_engine, MethodSpec("rkv", budget=N, method_args={"interval": 2, "window_size": 2}), 3)
    w, lam = 2, 0.1
    for layer, recs in seen["decode"].items():
        rec = dict(recs[-1])
        rec["q"] = torch.cat([recs[-2]["q"], recs[-1]["q"]])
        rec["qpos"] = torch.tensor([N, N + 1])
        T = N + 2
        m = T - w
        imp = probs_of(rec)[:, :, :m].mean(1).reshape(2, 2, m).max(1).values
        imp = F.max_pool1d(imp[:, None], 7, stride=1, padding=3)[:, 0]
        unit = F.normalize(rec["k"][:, :m].float(), dim=-1)
        sim = unit @ unit.transpose(1, 2)
        sim = sim * (1 - torch.eye(m))
        red = torch.softmax(sim.mean(-1), -1)
        s = lam * imp - (1 - lam) * red
        for h in range(2):
            assert kept[layer][h] == top(s[h], N - w) + [m, m + 1], (layer, h)


# --- 3. pages really go back to the pool; per-head / per-layer budgets add up ---------------------
@pytest.mark.slow
def test_pages_freed_and_budgets_add_up():
    engine = make_engine(None, num_pages=20000, prefill_chunk_size=512, max_num_batched_tokens=4096)
    prompt = chat(engine, haystack(12) + " What color is item 3?")
    n, budget = len(prompt), 48
    L, H, P = engine.shape.num_layers, engine.shape.num_kv_heads, engine.config.page_size
    names = ["h2o", "tova", "snapkv", "pyramidkv", "adakv", "keydiff", "expected_attention"]  # rkv: decode-time only
    specs = {
        m: MethodSpec(m, budget=budget, method_args={"window_size": 8} if m in ("snapkv", "pyramidkv") else {})
        for m in names
    }
    specs["pyramidkv"].method_args["beta"] = (
        2  # beta 20 would keep B/20 < window in the top layer: kvpress then falls back to snapkv
    )
    engine.controller.method_for(specs["adakv"]).scorer.params.window_size = 8  # its scorer's window, as snapkv's
    free_before = engine.pool.num_free
    ids = {m: engine.add_request(prompt, SamplingParams(max_tokens=4, ignore_eos=True), method=specs[m]) for m in names}
    engine.step()  # every prompt in, compressed, and its first token sampled
    held = 0
    for m, rid in ids.items():
        lengths, pages = engine.manager.seq_lengths(rid), engine.manager.pages_per_head(rid)
        assert torch.equal(pages, (lengths + P - 1) // P), m  # pages in use = ceil(kept / page_size) per head
        if m == "pyramidkv":
            per_layer = lengths[:, 0]
            assert bool((lengths == per_layer[:, None]).all()) and int(lengths.sum()) == H * sum(
                pyramid_budgets(L, budget, 8, n, 2)
            )
            assert int(per_layer[0]) > budget > int(per_layer[-1])  # falling from bottom to top
        elif m == "adakv":
            assert lengths.sum(1).eq(H * budget).all() and not bool(lengths.eq(budget).all())
        else:
            assert lengths.eq(budget).all(), m
        held += int(pages.sum())
    assert free_before - engine.pool.num_free == held  # everything evicted went back to the pool
    assert engine.controller.evicted_pages == len(ids) * L * H * math.ceil(n / P) - held
    while engine.has_unfinished():
        engine.step()
    assert engine.pool.num_free == free_before


# --- the backend computes attention probabilities only for methods that ask -----------------------
def test_probabilities_only_when_asked(tiny_engine):
    calls = []
    backend = tiny_engine.runner.backend
    orig_decode, orig_prefill = backend.decode, backend.prefill

    def decode(pool, view, q, scale, want_probs=False):
        calls.append(("decode", want_probs))
        return orig_decode(pool, view, q, scale, want_probs)

    def prefill(pool, view, q, q_pos, scale, probs_window=0, **kw):
        calls.append(("prefill", probs_window))
        return orig_prefill(pool, view, q, q_pos, scale, probs_window, **kw)

    backend.decode, backend.prefill = decode, prefill
    try:
        for spec, expect in [
            (MethodSpec("dense"), {("prefill", 0), ("decode", False)}),
            (MethodSpec("keydiff", budget=B), {("prefill", 0), ("decode", False)}),
            (MethodSpec("snapkv", budget=B, method_args={"window_size": 8}), {("prefill", 8), ("decode", False)}),
            (MethodSpec("tova", budget=B), {("prefill", 1), ("decode", True)}),
        ]:
            calls.clear()
            tiny_engine.generate([list(range(1, N + 1))], SamplingParams(max_tokens=3, ignore_eos=True), method=spec)
            assert set(calls) == expect, spec.method
    finally:
        backend.decode, backend.prefill = orig_decode, orig_prefill


# --- 4. the command line ----------------------------------------------------------------------------
@pytest.mark.slow
def test_generate_snapkv_on_the_command_line():
    text = haystack(40) + " What color is item 3?"
    cmd = [
        sys.executable,
        "-m",
        "sidecar.cli",
        "generate",
        "--method",
        "snapkv",
        "--budget",
        "256",
        "--chat",
        "--json",
        "--max-tokens",
        "8",
        "--num-pages",
        "8000",
        text,
    ]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["method"] == "snapkv" and out["usage"]["prompt_tokens"] > 256
    assert out["usage"]["evicted_tokens"] > 0 and len(out["token_ids"]) == 8


def test_help_lists_every_method_with_its_parameters():
    import dataclasses

    from engine.methods import describe

    text = describe()
    for name, cls in REGISTRY.items():
        assert f"  {name} " in text
        for f in dataclasses.fields(cls.Params) if cls.Params else ():
            assert f"{f.name}={f.default}" in text, (name, f.name)


def test_h2o_state_survives_a_snapshot(tiny_engine):
    """A session's accumulated H2O scores go into its snapshot and come back with it."""
    spec = MethodSpec("h2o", budget=B)
    m = tiny_engine.controller.method_for(spec)
    tiny_engine.add_turn(
        "h2o-session", list(range(1, N + 1)), SamplingParams(max_tokens=2, ignore_eos=True), method=spec
    )
    while tiny_engine.has_unfinished():
        tiny_engine.step()
    state = m.state_dict("h2o-session")
    assert sorted(state) == [f"acc.{layer}" for layer in range(3)] and all(t.shape == (2, B) for t in state.values())
    snap = tiny_engine.snapshot_session("h2o-session")
    tiny_engine.end_session("h2o-session")
    assert m.state_dict("h2o-session") == {}
    tiny_engine.load_session(snap)
    tiny_engine.add_turn("h2o-session", [5, 6, 7], SamplingParams(max_tokens=1), method=spec)  # restores, then runs
    while tiny_engine.has_unfinished():
        tiny_engine.step()
    assert sorted(m.state_dict("h2o-session")) == sorted(state)
    tiny_engine.end_session("h2o-session")
