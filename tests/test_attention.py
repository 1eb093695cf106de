"""Reference paged attention vs plain softmax attention over each head's own tokens."""

from __future__ import annotations

import pytest
import torch

from engine.attention.reference import ReferenceAttention
from engine.cache.manager import CacheManager
from engine.cache.pages import PagePool
from engine.cache.view import AttentionView


def setup(H, G, D, P, lengths_per_seq, seed=0):
    g = torch.Generator().manual_seed(seed)
    B = len(lengths_per_seq)
    pool = PagePool(4096, P, D, torch.float32, torch.device("cpu"))
    mgr = CacheManager(pool, 1, H, B, 512)
    kv = []
    for b, lens in enumerate(lengths_per_seq):
        mgr.open(b)
        n = max(lens)
        slots = mgr.append([b], [n], torch.arange(n))
        k = torch.randn(n, H, D, generator=g)
        v = torch.randn(n, H, D, generator=g)
        ReferenceAttention().store_kv(pool, slots[0], k, v)
        keep = [torch.randperm(n, generator=g)[:m].sort().values for m in lens]  # per-head subsets
        mgr.evict(b, 0, keep)
        kv.append([(k[keep[h], h], v[keep[h], h], keep[h]) for h in range(H)])
    return pool, mgr, kv


def naive(q, k, v, scale):
    return torch.softmax((q @ k.T) * scale, -1) @ v


@pytest.mark.parametrize("G", [1, 4, 8])
@pytest.mark.parametrize("P", [4, 16])
def test_decode_matches_naive_per_head(G, P):
    H, D = 2, 8
    lens = [[5, 37], [64, 1], [20, 20]]
    pool, mgr, kv = setup(H, G, D, P, lens)
    B = len(lens)
    q = torch.randn(B, H * G, D)
    tables, lengths = mgr.view_tables(torch.arange(B), 0, mgr.max_pages)
    out, probs = ReferenceAttention().decode(pool, AttentionView(tables, lengths, P), q, D**-0.5, want_probs=True)
    for b in range(B):
        for h in range(H):
            k, v, _ = kv[b][h]
            for g in range(G):
                qh = q[b, h * G + g]
                torch.testing.assert_close(out[b, h * G + g], naive(qh[None], k, v, D**-0.5)[0], rtol=1e-5, atol=1e-5)
                p = probs[b, h * G + g]
                assert abs(float(p.sum()) - 1) < 1e-5 and float(p[lens[b][h] :].abs().sum()) == 0


def test_selected_pages_restrict_decode():
    H, G, D, P = 2, 2, 8, 4
    pool, mgr, kv = setup(H, G, D, P, [[16, 16]])
    q = torch.randn(1, H * G, D)
    tables, lengths = mgr.view_tables(torch.arange(1), 0, 4)
    sel = torch.tensor([[[0, 2, -1], [3, -1, -1]]])
    out, _ = ReferenceAttention().decode(pool, AttentionView(tables, lengths, P, selected_pages=sel), q, D**-0.5)
    for h, pages in enumerate([[0, 2], [3]]):
        idx = torch.cat([torch.arange(p * P, (p + 1) * P) for p in pages])
        k, v, _ = kv[0][h]
        for g in range(G):
            torch.testing.assert_close(out[0, h * G + g], naive(q[0, h * G + g][None], k[idx], v[idx], D**-0.5)[0])


def test_prefill_is_causal_by_position():
    H, G, D, P = 2, 2, 8, 4
    pool, mgr, kv = setup(H, G, D, P, [[10, 3]])
    # a chunk of 4 new tokens at positions 10..13 attends the kept tokens and itself causally
    n = 4
    slots = mgr.append([0], [n], torch.arange(10, 10 + n))
    k_new, v_new = torch.randn(n, H, D), torch.randn(n, H, D)
    ReferenceAttention().store_kv(pool, slots[0], k_new, v_new)
    q = torch.randn(n, H * G, D)
    tables, lengths = mgr.view_tables(torch.arange(1), 0, mgr.max_pages)
    out, probs = ReferenceAttention().prefill(
        pool, AttentionView(tables, lengths, P), q, torch.arange(10, 10 + n), D**-0.5, probs_window=2
    )
    assert probs.shape == (H * G, 2, tables.shape[-1] * P)
    for h in range(H):
        k_old, v_old, _ = kv[0][h]
        for i in range(n):
            k = torch.cat([k_old, k_new[: i + 1, h]])
            v = torch.cat([v_old, v_new[: i + 1, h]])
            for g in range(G):
                torch.testing.assert_close(out[i, h * G + g], naive(q[i, h * G + g][None], k, v, D**-0.5)[0])


def test_non_finite_values_past_a_heads_end_are_never_read():
    """Slots a view does not let attention read (past a head's end in its last page, or in the page
    that a ``-1`` table entry of a shorter head is clamped to) may hold anything, NaN included:
    a CUDA graph's padding rows write there. Decode and prefill must give the same output as with
    zeros there (a masked softmax weight of 0 times NaN is NaN: the H200 bug of issue 3)."""
    H, G, D, P = 2, 2, 8, 4
    pool, mgr, kv = setup(H, G, D, P, [[13, 3]])  # uneven heads: head 1's table ends 3 pages early
    n = 4
    slots = mgr.append([0], [n], torch.arange(40, 40 + n))
    ReferenceAttention().store_kv(pool, slots[0], torch.randn(n, H, D), torch.randn(n, H, D))
    tables, lengths = mgr.view_tables(torch.arange(1), 0, mgr.max_pages)
    view = AttentionView(tables, lengths, P)
    q1, qn = torch.randn(1, H * G, D), torch.randn(n, H * G, D)
    clean = (
        ReferenceAttention().decode(pool, view, q1, D**-0.5)[0],
        ReferenceAttention().prefill(pool, view, qn, torch.arange(40, 40 + n), D**-0.5)[0],
    )
    readable = view.readable()[0]  # [H, T]
    pages = tables[0].long().clamp(min=0)
    flat = (pages[..., None] * P + torch.arange(P)).reshape(H, -1)
    hidden = flat[~readable].unique()
    hidden = hidden[~torch.isin(hidden, flat[readable])]  # (a clamped entry names a page another head reads)
    assert hidden.numel() and (tables[0] < 0).any()
    pool.k.view(-1, D)[hidden] = float("nan")
    pool.v.view(-1, D)[hidden] = float("inf")
    dirty = (
        ReferenceAttention().decode(pool, view, q1, D**-0.5)[0],
        ReferenceAttention().prefill(pool, view, qn, torch.arange(40, 40 + n), D**-0.5)[0],
    )
    for a, b in zip(clean, dirty):
        assert torch.equal(a, b)


@pytest.mark.parametrize("n", [1, 13, 40])
def test_triton_prefill_with_uniform_heads_equals_the_reference(n):
    """The GPU backend's prefill skips the per-head mask when every head holds the same tokens (its
    torch code runs on the CPU too): the same outputs and window probabilities as the oracle."""
    pytest.importorskip("triton")
    from engine.attention.triton_paged import TritonPagedAttention

    H, G, D, P, before = 2, 4, 8, 4, 30
    g = torch.Generator().manual_seed(n)
    pool = PagePool(256, P, D, torch.float32, torch.device("cpu"))
    mgr = CacheManager(pool, 1, H, 1, 512)
    mgr.open(0)
    total = before + n
    slots = mgr.append([0], [total], torch.arange(total))
    ReferenceAttention().store_kv(
        pool, slots[0], torch.randn(total, H, D, generator=g), torch.randn(total, H, D, generator=g)
    )
    tables, lengths = mgr.view_tables(torch.tensor([0]), 0, mgr.max_pages)
    view = AttentionView(tables, lengths, P)
    q = torch.randn(n, H * G, D, generator=g)
    q_pos = torch.arange(before, total)
    ref_out, ref_probs = ReferenceAttention().prefill(pool, view, q, q_pos, D**-0.5, probs_window=8)
    out, probs = TritonPagedAttention(torch.device("cpu")).prefill(
        pool, view, q, q_pos, D**-0.5, probs_window=8, uniform_length=total
    )
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(probs, ref_probs[..., :total], rtol=1e-5, atol=1e-6)
    assert float(ref_probs[..., total:].abs().sum()) == 0
