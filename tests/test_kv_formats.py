"""Quantized page formats (engine/cache/formats.py) under the PagePool and CacheManager: round trips
within the quantization error, the full-precision open page, real storage sizes, copy-on-write,
compaction and snapshots with quantized pages. No model: fast."""

from __future__ import annotations

import pytest
import torch

from engine.cache.formats import FormatError, make_format
from engine.cache.manager import CacheManager
from engine.cache.pages import OutOfPages, PagePool

L, H, D, P = 2, 2, 64, 16
CPU = torch.device("cpu")


def make(fmt: str, args=(), num_pages=64, max_seqs=4, dtype=torch.float32):
    f = make_format(fmt, dict(args), P, D, dtype)
    pool = PagePool(num_pages, P, D, dtype, CPU, format=f, max_open_pages=max_seqs * L * H * f.staging_per_head)
    return pool, CacheManager(pool, L, H, max_seqs, 256)


def data(n: int, seed: int = 0):
    """Key-like data (a few outlier channels) and value-like data, ``[n, H, D]``."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(n, H, D, generator=g)
    k[..., :4] *= 8  # outlier channels, as in real keys
    v = torch.randn(n, H, D, generator=g)
    return k, v


def fill(mgr, seq, k, v, start=0):
    n = k.shape[0]
    slots = mgr.append([seq], [n], torch.arange(start, start + n))
    for layer in range(L):
        mgr.pool.write_tokens(slots[layer], k + layer, v - layer)


def read(mgr, seq, layer):
    k, v, _, lengths = mgr.gather(seq, layer)
    n = int(lengths[0])
    return k[:, :n].permute(1, 0, 2), v[:, :n].permute(1, 0, 2)  # [n, H, D]


# kivi without a residual window (only the open page is full precision), so that sealed pages are
# exercised on short sequences; the window has its own tests below
K0 = (("residual_length", 0),)
FORMATS = [
    ("plain", ()),
    ("fp8", ()),
    ("fp8", (("fp8", "e5m2"),)),
    ("kivi", (("bits", 4),) + K0),
    ("kivi", (("bits", 2),) + K0),
    ("kivi", (("bits", 2), ("residual_length", 24))),
]


@pytest.mark.parametrize("fmt,args", FORMATS)
def test_round_trip_within_quantization_error(fmt, args):
    pool, mgr = make(fmt, args)
    mgr.open("a")
    k, v = data(40)  # two full pages and an open one of 8 tokens per head
    fill(mgr, "a", k, v)
    rk, rv = read(mgr, "a", 1)
    k, v = k + 1, v - 1
    err_k = ((rk - k).norm() / k.norm()).item()
    err_v = ((rv - v).norm() / v.norm()).item()
    bound = {"plain": 0, "fp8": 0.1, "kivi": 0.12 if dict(args).get("bits") == 4 else 0.6}[fmt]
    assert err_k <= bound and err_v <= bound, (err_k, err_v)
    if fmt == "kivi":  # the open page and the pages holding the last R tokens are full precision; sealed pages are not
        R = dict(args)["residual_length"]
        exact = 40 - (40 - R) // P * P  # R = 0: the open page (8 tokens); R = 24: pages 1-2 (24 tokens)
        assert torch.equal(rk[40 - exact :], k[40 - exact :]) and torch.equal(rv[40 - exact :], v[40 - exact :])
        assert not torch.equal(rk[:16], k[:16])
        tables = mgr.tables[mgr.slot("a")].flatten()
        assert pool.format.num_open(tables[tables >= 0]) == L * H * (1 if not R else 2)


def test_kivi_rule_keys_per_channel_values_per_token():
    """A key channel that is constant over a page and a value token that is constant over a group
    are exact: keys share a scale/zero per (page, channel), values per (token, channel group)."""
    pool, mgr = make("kivi", (("bits", 2),) + K0)
    mgr.open("a")
    k, v = data(P)
    k[:, :, 5] = 3.25
    v[7, :, :32] = -1.5
    fill(mgr, "a", k, v)
    rk, rv = read(mgr, "a", 0)
    assert torch.allclose(rk[:, :, 5], torch.full_like(rk[:, :, 5], 3.25), atol=1e-3)
    assert torch.allclose(rv[7, :, :32], torch.full_like(rv[7, :, :32], -1.5), atol=1e-3)
    # 2-bit codes: at most 4 distinct values per key channel in a page
    assert int(rk[:, 0, 9].unique().numel()) <= 4


@pytest.mark.parametrize(
    "fmt,args,ratio", [("fp8", (), 0.55), ("kivi", (("bits", 2),), 0.3), ("kivi", (("bits", 4),), 0.45)]
)
def test_storage_is_really_smaller(fmt, args, ratio):
    """The accounting is the bytes of the tensors the format really allocated, and a quantized
    page costs a fraction of a bf16 page."""
    plain, _ = make("plain", dtype=torch.bfloat16, num_pages=256)
    pool, _ = make(fmt, args, dtype=torch.bfloat16, num_pages=256)
    real = sum(t.numel() * t.element_size() for t in pool.format._tensors()) + pool.pos.numel() * 4
    assert pool.storage_bytes == real
    assert plain.storage_bytes == 256 * plain.bytes_per_page
    assert pool.bytes_per_page <= ratio * plain.bytes_per_page
    assert pool.storage_bytes < plain.storage_bytes
    with pytest.raises(AttributeError, match="read_pages"):
        pool.k


def test_kivi_staging_follows_open_pages_and_accounting_counts_it():
    pool, mgr = make("kivi", (("bits", 2),) + K0)
    free0 = pool.format.num_staging_free
    mgr.open("a")
    fill(mgr, "a", *data(20))
    assert pool.format.num_staging_free == free0 - L * H  # one open page per head
    per_head = pool.bytes_per_page * 2 + pool.format.open_page_bytes
    assert mgr.kv_bytes("a") == L * H * per_head
    fill(mgr, "a", *data(12, seed=1), start=20)  # fills the open pages: all sealed
    assert pool.format.num_staging_free == free0
    assert mgr.kv_bytes("a") == L * H * 2 * pool.bytes_per_page
    fill(mgr, "a", *data(3, seed=2), start=32)
    mgr.release("a")
    assert pool.format.num_staging_free == free0 and pool.num_free == pool.num_pages


@pytest.mark.parametrize("fmt,args", FORMATS)
def test_fork_copy_on_write_of_an_open_page(fmt, args):
    pool, mgr = make(fmt, args)
    mgr.open("p")
    fill(mgr, "p", *data(20))
    before = read(mgr, "p", 0)
    mgr.fork("p", "c")
    fill(mgr, "c", *data(4, seed=3), start=20)  # writes into the shared open page: copied first
    after = read(mgr, "p", 0)
    assert torch.equal(before[0], after[0]) and torch.equal(before[1], after[1])
    ck, _ = read(mgr, "c", 0)
    assert torch.equal(ck[:16], before[0][:16])  # the shared full page is still shared
    assert ck.shape[0] == 24
    mgr.release("c")
    mgr.release("p")
    assert pool.num_free == pool.num_pages


@pytest.mark.parametrize("fmt,args", FORMATS)
def test_eviction_compaction_with_quantized_pages(fmt, args):
    pool, mgr = make(fmt, args)
    mgr.open("a")
    fill(mgr, "a", *data(40))
    k0, v0 = read(mgr, "a", 0)
    keep = torch.cat([torch.arange(4), torch.arange(30, 40)])
    freed = mgr.evict("a", 0, keep.expand(H, -1))
    assert freed == 2 * H
    k1, v1 = read(mgr, "a", 0)
    if fmt in ("plain", "fp8"):  # self-contained tokens move exactly
        assert torch.equal(k1, k0[keep]) and torch.equal(v1, v0[keep])
    else:  # kivi re-quantizes the page the moved tokens land in
        assert ((k1 - k0[keep]).norm() / k0[keep].norm()) < 0.6
        assert torch.equal(k1[:4], k0[:4])  # unmoved tokens of the now open page: unchanged
    mgr.evict("a", 0, torch.arange(3).expand(H, -1))  # truncation (a rolled-back turn)
    k2, _ = read(mgr, "a", 0)
    assert torch.equal(k2, k1[:3])
    mgr.release("a")
    assert pool.num_free == pool.num_pages


@pytest.mark.parametrize("fmt,args", FORMATS)
def test_snapshot_restore_reproduces_the_pages(fmt, args):
    pool, mgr = make(fmt, args)
    mgr.open("a")
    fill(mgr, "a", *data(37))
    snap = mgr.snapshot("a")
    assert snap.k.dtype == torch.float32 and snap.k.shape == (L * H * 37, D)
    mgr.restore("b", snap)
    for layer in range(L):
        ka, va = read(mgr, "a", layer)
        kb, vb = read(mgr, "b", layer)
        # re-quantizing dequantized values gives the same codes: the restore is lossless
        assert torch.allclose(ka, kb, atol=1e-5) and torch.allclose(va, vb, atol=1e-5)


def test_kivi_residual_window_keeps_the_last_r_tokens_exact():
    """KIVI's residual (R = 32, two pages): a page is quantized only once all its tokens are R or
    more tokens old, whether tokens come one at a time (decode) or in a chunk (prefill), and the
    accounting counts every staged page."""
    R = 32
    pool, mgr = make("kivi", (("bits", 2), ("residual_length", R)), num_pages=128)
    free0 = pool.format.num_staging_free
    k, v = data(100)
    mgr.open("a")
    mgr.open("b")
    fill(mgr, "b", k[:70], v[:70])  # one chunk
    for t in range(70):  # one token at a time
        fill(mgr, "a", k[t : t + 1], v[t : t + 1], start=t)
        n = t + 1
        sealed = max(0, (n - R) // P)  # pages whose last token is at least R tokens old
        rk, rv = read(mgr, "a", 0)
        assert torch.equal(rk[sealed * P :], k[sealed * P : n]) and torch.equal(rv[sealed * P :], v[sealed * P : n])
        if sealed:
            assert not torch.equal(rk[: sealed * P], k[: sealed * P])
        staged = -(-n // P) - sealed
        assert staged <= pool.format.staging_per_head == 3
        assert mgr.kv_bytes("a") == L * H * (-(-n // P) * pool.bytes_per_page + staged * pool.format.open_page_bytes)
    for layer in range(L):  # the chunk and the token-by-token session hold the same pages
        ka, va = read(mgr, "a", layer)
        kb, vb = read(mgr, "b", layer)
        assert torch.equal(ka, kb) and torch.equal(va, vb)
    assert torch.equal(read(mgr, "b", 0)[0][(70 - R) // P * P :], k[(70 - R) // P * P : 70])
    assert pool.format.num_staging_free == free0 - 2 * L * H * 3
    mgr.release("a")
    mgr.release("b")
    assert pool.format.num_staging_free == free0 and pool.num_free == pool.num_pages


def test_bad_formats_and_exhausted_staging():
    with pytest.raises(FormatError, match="2 or 4 bits"):
        make_format("kivi", {"bits": 3}, P, D, torch.float32)
    with pytest.raises(FormatError, match="divide head_dim"):
        make_format("kivi", {"value_group": 48}, P, D, torch.float32)
    with pytest.raises(FormatError, match="residual_length"):
        make_format("kivi", {"residual_length": -1}, P, D, torch.float32)
    with pytest.raises(FormatError, match="e4m3 or e5m2"):
        make_format("fp8", {"fp8": "e3m4"}, P, D, torch.float32)
    with pytest.raises(FormatError, match="unknown KV page format"):
        make_format("int3", {}, P, D, torch.float32)
    f = make_format("kivi", {}, P, D, torch.float32)
    pool = PagePool(16, P, D, torch.float32, CPU, format=f, max_open_pages=1)
    mgr = CacheManager(pool, L, H, 2, 64)
    mgr.open("a")
    slots = mgr.append(["a"], [3], torch.arange(3))
    with pytest.raises(OutOfPages, match="staging"):
        pool.write_tokens(slots[0], *data(3))
