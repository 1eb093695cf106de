"""Triton paged kernels vs the reference attention (on the GPU; on the CPU under Triton's interpreter).

Covers dense and sparse page lists, per-head lengths, GQA ratios 1/4/8, page sizes 16/32 and the
score output. Fresh random inputs each case; outputs poisoned before each run.
"""

from __future__ import annotations

import os

import pytest
import torch

triton = pytest.importorskip("triton")
if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    # tests/conftest.py sets TRITON_INTERPRET=1 on a machine without CUDA unless it was set otherwise
    pytest.skip("Triton kernels need a CUDA device (or TRITON_INTERPRET=1)", allow_module_level=True)


def _interpreter_scalar_bounds() -> None:
    """Triton's interpreter turns a loaded scalar (a loop bound such as a head's length) into an
    int with ``int(array)``, which numpy >= 2.4 refuses for a 1-element array; convert it through
    ``.item()`` instead. Only the interpreter is patched; compiled kernels are untouched."""
    from triton.runtime import interpreter

    patch = interpreter._patch_lang_tensor
    if getattr(patch, "scalar_bounds", False):
        return

    def patched(tensor, scope):
        patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0].item()))

    patched.scalar_bounds = True
    interpreter._patch_lang_tensor = patched


if os.environ.get("TRITON_INTERPRET") == "1":
    _interpreter_scalar_bounds()

from engine.attention.reference import ReferenceAttention  # noqa: E402
from engine.attention.triton_paged import TritonPagedAttention, gather_tokens, paged_decode, scatter_tokens, store_kv  # noqa: E402
from engine.cache.manager import CacheManager  # noqa: E402
from engine.cache.pages import PagePool  # noqa: E402
from engine.cache.view import AttentionView  # noqa: E402

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPE = torch.bfloat16 if DEV.type == "cuda" else torch.float32
TOL = 2e-2 if DTYPE == torch.bfloat16 else 1e-4
INTERPRETED = DEV.type == "cpu"
"""Under the interpreter every program runs in Python: the decode cases are smaller (same shapes of
case: a head of a few tokens, one of one token, whole pages, partial pages, several splits)."""


def build(H, D, P, lens, seed):
    g = torch.Generator().manual_seed(seed)
    B = len(lens)
    pool = PagePool(2048, P, D, DTYPE, DEV)
    mgr = CacheManager(pool, 1, H, B + 1, 1024)
    for b, per_head in enumerate(lens):
        mgr.open(b)
        n = max(per_head)
        slots = mgr.append([b], [n], torch.arange(n))
        k = torch.randn(n, H, D, generator=g).to(DEV, DTYPE)
        v = torch.randn(n, H, D, generator=g).to(DEV, DTYPE)
        ReferenceAttention().store_kv(pool, slots[0], k, v)
        keep = [torch.randperm(n, generator=g)[:m].sort().values for m in per_head]
        mgr.evict(b, 0, keep)
    return pool, mgr


def rel_err(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-6))


@pytest.mark.parametrize("G", [1, 4, 8])
@pytest.mark.parametrize("P", [16, 32])
def test_decode_matches_reference(G, P):
    H, D = 2, 64
    lens = [[3, 20], [17, 1], [16, 16], [50, 9]] if INTERPRETED else [[3, 200], [129, 1], [64, 64], [500, 77]]
    pool, mgr = build(H, D, P, lens, seed=G * 100 + P)
    B = len(lens)
    q = torch.randn(B, H * G, D, generator=torch.Generator().manual_seed(7)).to(DEV, DTYPE)
    tables, lengths = mgr.view_tables(torch.arange(B, device=DEV), 0, mgr.max_pages)
    view = AttentionView(tables, lengths, P)
    ref, ref_p = ReferenceAttention().decode(pool, view, q, D**-0.5, want_probs=True)
    for splits in (1, 3) if INTERPRETED else (1, 3, 8):
        rows = torch.arange(B, dtype=torch.int32, device=DEV)
        scores = torch.full((B, H * G, mgr.max_pages * P), float("-inf"), device=DEV)
        out = torch.full_like(q, float("nan"))
        out, lse = paged_decode(
            q, pool.k, pool.v, tables, lengths, rows, D**-0.5, splits=splits, scores=scores, out=out
        )
        assert not torch.isnan(out).any()
        assert rel_err(out, ref) < TOL
        probs = torch.exp(scores - lse[..., None])
        assert float((probs - ref_p).abs().max()) < TOL
    # the backend (the engine's entry point) agrees as well
    out, probs = TritonPagedAttention(DEV).decode(pool, view, q, D**-0.5, want_probs=True)
    assert rel_err(out, ref) < TOL and float((probs - ref_p).abs().max()) < TOL


def test_decode_reads_global_tables_through_rows():
    """The CUDA-graph path: rows index the manager's global tables of one layer."""
    H, D, P, G = 2, 64, 16, 4
    pool, mgr = build(H, D, P, [[40, 90], [17, 5]], seed=3)
    q = torch.randn(2, H * G, D).to(DEV, DTYPE)
    rows = torch.tensor([1, 0], dtype=torch.int32, device=DEV)  # batch row b reads slot rows[b]
    out, _ = paged_decode(q, pool.k, pool.v, mgr.tables_dev[:, 0], mgr.lengths_dev[:, 0], rows, D**-0.5, splits=2)
    tables, lengths = mgr.view_tables(rows.long(), 0, mgr.max_pages)
    ref, _ = ReferenceAttention().decode(pool, AttentionView(tables, lengths, P), q, D**-0.5)
    assert rel_err(out, ref) < TOL


@pytest.mark.parametrize("P", [16, 32])
def test_sparse_page_lists(P):
    H, D, G = 2, 64, 4
    pool, mgr = build(H, D, P, [[300, 300], [150, 90]], seed=P)
    B = 2
    q = torch.randn(B, H * G, D).to(DEV, DTYPE)
    tables, lengths = mgr.view_tables(torch.arange(B, device=DEV), 0, mgr.max_pages)
    sel = torch.full((B, H, 6), -1, dtype=torch.long)
    sel[0, 0, :3] = torch.tensor([0, 5, 8])
    sel[0, 1, :2] = torch.tensor([2, 3])
    sel[1, 0, :3] = torch.tensor([4, 1, 0])  # any order; the last page is partly filled
    sel[1, 1, :1] = torch.tensor([2])
    sel = sel.to(DEV)
    ref, _ = ReferenceAttention().decode(pool, AttentionView(tables, lengths, P, selected_pages=sel), q, D**-0.5)
    out, _ = TritonPagedAttention(DEV).decode(pool, AttentionView(tables, lengths, P, selected_pages=sel), q, D**-0.5)
    assert rel_err(out, ref) < TOL


def test_prefill_matches_reference():
    H, D, P, G = 2, 64, 16, 4
    pool, mgr = build(H, D, P, [[70, 33]], seed=11)
    n = 24
    slots = mgr.append([0], [n], torch.arange(100, 100 + n))
    k_new = torch.randn(n, H, D).to(DEV, DTYPE)
    v_new = torch.randn(n, H, D).to(DEV, DTYPE)
    TritonPagedAttention(DEV).store_kv(pool, slots[0], k_new, v_new)
    q = torch.randn(n, H * G, D).to(DEV, DTYPE)
    tables, lengths = mgr.view_tables(torch.arange(1, device=DEV), 0, mgr.max_pages)
    view = AttentionView(tables, lengths, P)
    qpos = torch.arange(100, 100 + n, device=DEV)
    ref, ref_w = ReferenceAttention().prefill(pool, view, q, qpos, D**-0.5, probs_window=5)
    out, w = TritonPagedAttention(DEV).prefill(pool, view, q, qpos, D**-0.5, probs_window=5)
    assert rel_err(out, ref) < TOL and float((w - ref_w).abs().max()) < TOL


def test_store_and_move_tokens():
    D, P = 64, 16
    pool = PagePool(64, P, D, DTYPE, DEV)
    slots = torch.randperm(64 * P)[:40].reshape(20, 2).to(DEV)
    k = torch.randn(20, 2, D).to(DEV, DTYPE)
    v = torch.randn(20, 2, D).to(DEV, DTYPE)
    store_kv(pool.k, pool.v, slots, k, v)
    assert torch.equal(pool.k.view(-1, D)[slots.reshape(-1)], k.reshape(-1, D))
    assert torch.equal(pool.v.view(-1, D)[slots.reshape(-1)], v.reshape(-1, D))
    pool.pos.view(-1)[slots.reshape(-1)] = torch.arange(40, dtype=torch.int32, device=DEV)
    src = slots.reshape(-1)[:10]
    data = gather_tokens(pool, src)
    dst = torch.arange(10, device=DEV) + 5 * P
    scatter_tokens(pool, dst, data)
    assert torch.equal(pool.k.view(-1, D)[dst], k.reshape(-1, D)[:10])
    assert torch.equal(pool.pos.view(-1)[dst], torch.arange(10, dtype=torch.int32, device=DEV))


def test_fused_decoder_ops_match_torch():
    from engine.model import ops

    g = torch.Generator().manual_seed(5)
    x = torch.randn(7, 96, generator=g).to(DEV, DTYPE)
    r = torch.randn(7, 96, generator=g).to(DEV, DTYPE)
    w = torch.randn(96, generator=g).to(DEV, DTYPE)
    out, res = ops._add_rms_norm_triton(x, r, w, 1e-5)
    ref_res = x + r
    ref = w * (ref_res.float() * torch.rsqrt(ref_res.float().pow(2).mean(-1, keepdim=True) + 1e-5)).to(DTYPE)
    assert rel_err(res, ref_res) < TOL and rel_err(out, ref) < TOL
    out2, same = ops._add_rms_norm_triton(x, None, w, 1e-5)
    assert (
        same is x
        and rel_err(out2, w * (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-5)).to(DTYPE)) < TOL
    )

    N, HQ, HK, D = 5, 8, 2, 64
    qkv = torch.randn(N, (HQ + 2 * HK) * D, generator=g).to(DEV, DTYPE)
    q, k, v = qkv.split([HQ * D, HK * D, HK * D], dim=-1)
    q, k = q.view(N, HQ, D), k.view(N, HK, D)
    pos = torch.tensor([0, 3, 17, 100, 5], device=DEV)
    inv = 1.0 / (10000 ** (torch.arange(0, D, 2).float() / D))
    ang = torch.arange(128).float()[:, None] * inv[None, :]
    cos, sin = torch.cat([ang, ang], -1).cos().to(DEV), torch.cat([ang, ang], -1).sin().to(DEV)
    ref_q, ref_k = (t.clone() for t in (q, k))
    c, s = cos[pos].to(DTYPE)[:, None], sin[pos].to(DTYPE)[:, None]
    half = lambda t: torch.cat([-t[..., D // 2 :], t[..., : D // 2]], -1)  # noqa: E731
    ref_q, ref_k = ref_q * c + half(ref_q) * s, ref_k * c + half(ref_k) * s
    ops._rope_triton(q, k, pos, cos, sin)  # in place, through the strided views
    assert rel_err(q, ref_q) < TOL and rel_err(k, ref_k) < TOL

    gu = torch.randn(4, 2 * 300, generator=g).to(DEV, DTYPE)
    ref = torch.nn.functional.silu(gu[:, :300]) * gu[:, 300:]
    assert rel_err(ops._silu_mul_triton(gu), ref) < TOL


def test_empty_rows_give_zeros_and_hidden_slots_are_never_read():
    """A row with nothing to read (a CUDA graph's padding row reads an empty cache slot) gives zeros,
    not 0/0 = NaN: its K/V in the next layer is written to the pool. And a prefill must not let a
    non-finite value in a slot its view hides (past a shorter head's end) reach the output."""
    H, D, P, G = 2, 64, 16, 4
    pool, mgr = build(H, D, P, [[70, 20]], seed=5)
    mgr.open("empty")
    rows = torch.tensor([0, mgr.slot("empty")], dtype=torch.int32, device=DEV)
    q = torch.randn(2, H * G, D).to(DEV, DTYPE)
    out, _ = paged_decode(q, pool.k, pool.v, mgr.tables_dev[:, 0], mgr.lengths_dev[:, 0], rows, D**-0.5, splits=3)
    assert bool(torch.isfinite(out).all()) and float(out[1].abs().max()) == 0

    n = 8
    slots = mgr.append([0], [n], torch.arange(100, 100 + n))
    TritonPagedAttention(DEV).store_kv(
        pool, slots[0], torch.randn(n, H, D).to(DEV, DTYPE), torch.randn(n, H, D).to(DEV, DTYPE)
    )
    tables, lengths = mgr.view_tables(torch.arange(1, device=DEV), 0, mgr.max_pages)
    view = AttentionView(tables, lengths, P)
    qn, qpos = torch.randn(n, H * G, D).to(DEV, DTYPE), torch.arange(100, 100 + n, device=DEV)
    clean, _ = TritonPagedAttention(DEV).prefill(pool, view, qn, qpos, D**-0.5)
    readable = view.readable()[0]
    flat = (tables[0].long().clamp(min=0)[..., None] * P + torch.arange(P, device=DEV)).reshape(H, -1)
    hidden = flat[~readable].unique()
    hidden = hidden[~torch.isin(hidden, flat[readable])]
    assert hidden.numel()
    pool.k.view(-1, D)[hidden] = float("nan")
    pool.v.view(-1, D)[hidden] = float("nan")
    dirty, _ = TritonPagedAttention(DEV).prefill(pool, view, qn, qpos, D**-0.5)
    assert torch.equal(clean, dirty)


@pytest.mark.parametrize("G,D", [(4, 64), (3, 64), (1, 128)])
def test_quest_page_scores_kernel_matches_torch(G, D):
    """The fused kernel reads each page's bounds through the table and scores them: the same
    values as Quest's rule over the gathered bounds (any page ids, -1 past a head's end)."""
    from engine.methods.quest import page_scores
    from engine.methods.quest_triton import page_scores_fused

    g = torch.Generator().manual_seed(G * D)
    B, H, NP, N = 3, 2, 150, 400
    q = torch.randn(B, H * G, D, generator=g).to(DEV, DTYPE)
    lo = torch.randn(N + 1, D, generator=g)
    hi = (lo + torch.rand(N + 1, D, generator=g)).to(DEV, DTYPE)
    lo = lo.to(DEV, DTYPE)
    tables = torch.randint(-1, N, (B, H, NP), generator=g, dtype=torch.int32).to(DEV)
    ids = tables.long().clamp(min=0)
    ref = page_scores(q, lo[ids], hi[ids])
    out = page_scores_fused(q, lo, hi, tables)
    assert out.shape == (B, H, NP) and out.dtype == torch.float32
    assert float((out - ref).abs().max()) <= 1e-3 * float(ref.abs().max())
