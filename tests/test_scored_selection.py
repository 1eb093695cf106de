"""The batched selection helpers of the scored eviction methods (one top-k for all heads, scores of
all heads at once) keep exactly what the per-head rule keeps, for heads of different lengths and
budgets — the case the engine meets after a method has evicted unevenly (adakv, a shared prefix)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.methods.h2o import h2o_scores
from engine.methods.scored import force_keep, topk_per_head
from engine.methods.snapkv import snapkv_scores


def per_head_topk(scores, lengths, budgets):
    out = []
    for h in range(scores.shape[0]):
        n, b = int(lengths[h]), int(budgets[h])
        out.append(list(range(n)) if n <= b else sorted(scores[h, :n].topk(b).indices.tolist()))
    return out


def per_head_snapkv(probs, lengths, kernel, pooling):
    """SnapKV head by head: each head's prefix pooled on its own, GQA mean, the window on top."""
    Hq, w, _ = probs.shape
    H = len(lengths)
    G = Hq // H
    pool = F.max_pool1d if pooling == "maxpool" else F.avg_pool1d
    rows = []
    for h in range(H):
        n = int(lengths[h])
        m = max(n - w, 0)
        p = probs[h * G : (h + 1) * G, :, :m].float().sum(1)
        if m:
            p = pool(p[:, None], kernel, stride=1, padding=kernel // 2)[:, 0, :m]
        p = p.mean(0)
        rows.append((p, m, n))
    return rows


def test_topk_per_head_matches_each_head_on_its_own():
    g = torch.Generator().manual_seed(0)
    for trial in range(20):
        H, T = 8, 300
        lengths = torch.randint(T // 2, T + 1, (H,), generator=g)
        lengths[0] = T
        budgets = torch.randint(10, T, (H,), generator=g).tolist()
        if trial % 2:
            budgets = [budgets[0]] * H  # one budget for the layer (the usual case)
        scores = torch.randn(H, T, generator=g)
        got = [k.tolist() for k in topk_per_head(scores, lengths, budgets)]
        assert got == per_head_topk(scores, lengths, budgets), trial
        assert all(len(k) == min(int(n), b) for k, n, b in zip(got, lengths, budgets))


def test_force_keep_ranks_forced_above_all_later_higher():
    s = torch.tensor([[0.5, -2.0, float("-inf"), 3.0, 1.0, 0.0]])
    keep = torch.tensor([[False, True, False, False, True, True]])
    out = force_keep(s, keep)
    forced = out[keep]
    assert bool((forced[1:] > forced[:-1]).all()) and float(forced.min()) > 3.0
    assert torch.equal(out[~keep], s[~keep])
    none_finite = force_keep(torch.full((1, 3), float("-inf")), torch.tensor([[True, False, True]]))
    assert none_finite[0, 0] < none_finite[0, 2] and none_finite[0, 1] == float("-inf")


@pytest.mark.parametrize("pooling", ["avgpool", "maxpool"])
def test_snapkv_scores_pool_each_head_on_its_own(pooling):
    g = torch.Generator().manual_seed(1)
    H, G, w, T, kernel = 4, 2, 6, 90, 5
    lengths = torch.tensor([90, 71, 40, 5])  # the last head is all window
    probs = torch.rand(H * G, w, T, generator=g).softmax(-1)
    scores = snapkv_scores(probs, lengths, kernel, pooling)
    for h, (p, m, n) in enumerate(per_head_snapkv(probs, lengths, kernel, pooling)):
        assert torch.allclose(scores[h, :m], p, atol=1e-6), h
        window = scores[h, m:n]
        assert bool((window[1:] > window[:-1]).all()) and (m == 0 or float(window.min()) > float(p.max())), h
        assert bool(torch.isinf(scores[h, n:]).all()) and bool((scores[h, n:] < 0).all())
    for budget in (20, 50):  # max-pooling makes ties: they fall as a head's own top-k lets them
        keep = [k.tolist() for k in topk_per_head(scores, lengths, [budget] * H)]
        assert keep == per_head_topk(scores, lengths, [budget] * H)


def test_h2o_scores_keep_the_recent_window_of_each_head():
    acc = torch.rand(3, 50, generator=torch.Generator().manual_seed(2))
    lengths = torch.tensor([50, 30, 12])
    s = h2o_scores(acc, lengths, recent=10)
    keep = topk_per_head(s, lengths, [16] * 3)
    for h, n in enumerate(lengths.tolist()):
        heavy = sorted(acc[h, : n - 10].topk(min(6, n - 10)).indices.tolist()) if n > 16 else list(range(n - 10))
        assert keep[h].tolist() == heavy + list(range(n - 10, n)), h
