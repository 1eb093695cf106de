"""PagePool and CacheManager: append, evict with compaction and freeing, fork (copy-on-write), snapshot."""

from __future__ import annotations

import pytest
import torch

from engine.cache.manager import CacheManager
from engine.cache.pages import OutOfPages, PagePool

L, H, D, P = 2, 3, 4, 4


def make(num_pages=64, max_seqs=4, max_len=64):
    pool = PagePool(num_pages, P, D, torch.float32, torch.device("cpu"))
    return pool, CacheManager(pool, L, H, max_seqs, max_len)


def fill(mgr: CacheManager, seq, n: int, start: int = 0):
    """Append n tokens whose K = V = position (so contents identify tokens) to every layer/head."""
    slots = mgr.append([seq], [n], torch.arange(start, start + n))
    pos = torch.arange(start, start + n, dtype=torch.float32)
    for layer in range(L):
        kv = (pos[:, None, None] + 1000 * layer + 100 * torch.arange(H)[None, :, None]).expand(n, H, D)
        flat = slots[layer].reshape(-1)
        mgr.pool.k.view(-1, D)[flat] = kv.reshape(-1, D)
        mgr.pool.v.view(-1, D)[flat] = -kv.reshape(-1, D)


def contents(mgr, seq, layer, head):
    k, v, pos, lengths = mgr.gather(seq, layer)
    n = int(lengths[head])
    return k[head, :n, 0].tolist(), pos[head, :n].tolist()


def invariant(pool: PagePool, mgr: CacheManager):
    """Every page is either free or referenced exactly refcount times by the page tables."""
    t = mgr.tables[mgr.tables >= 0].long()
    refs = torch.bincount(t, minlength=pool.num_pages)
    assert torch.equal(refs.to(torch.int32), pool.refcount)
    assert pool.num_free == int((pool.refcount == 0).sum())


def test_append_allocates_pages_per_head_and_records_positions():
    pool, mgr = make()
    mgr.open("a")
    fill(mgr, "a", 6)
    assert mgr.pages_per_head("a").tolist() == [[2] * H] * L
    assert pool.num_used == L * H * 2
    fill(mgr, "a", 3, start=6)
    assert mgr.seq_lengths("a").tolist() == [[9] * H] * L
    assert pool.num_used == L * H * 3
    k, pos = contents(mgr, "a", 1, 2)
    assert pos == list(range(9))
    assert k == [1000 + 200 + i for i in range(9)]
    invariant(pool, mgr)


def test_append_is_refused_whole_when_short_of_pages():
    pool, mgr = make(num_pages=10)
    mgr.open("a")
    before = pool.num_free
    with pytest.raises(OutOfPages):
        mgr.append(["a"], [8], torch.arange(8))  # 2 pages x 6 heads = 12 > 10
    assert pool.num_free == before and mgr.seq_lengths("a").sum() == 0


def test_evict_compacts_each_head_and_frees_pages():
    pool, mgr = make()
    mgr.open("a")
    fill(mgr, "a", 13)  # 4 pages per head
    free0 = pool.num_free
    keep = [torch.tensor([0, 5, 12]), torch.arange(13), torch.tensor([3])]
    freed = mgr.evict("a", 0, keep)
    assert mgr.pages_per_head("a")[0].tolist() == [1, 4, 1]
    assert mgr.seq_lengths("a")[0].tolist() == [3, 13, 1]
    assert freed == (4 - 1) + 0 + (4 - 1) and pool.num_free == free0 + freed
    assert contents(mgr, "a", 0, 0) == ([0.0, 5.0, 12.0], [0, 5, 12])
    assert contents(mgr, "a", 0, 2) == ([203.0], [3])
    assert contents(mgr, "a", 1, 0)[1] == list(range(13))  # other layers untouched
    # appending after eviction continues each head where it stands
    fill(mgr, "a", 2, start=13)
    assert contents(mgr, "a", 0, 0)[1] == [0, 5, 12, 13, 14]
    assert contents(mgr, "a", 0, 2)[1] == [3, 13, 14]
    invariant(pool, mgr)


def test_evict_rejects_bad_indices():
    _, mgr = make()
    mgr.open("a")
    fill(mgr, "a", 5)
    with pytest.raises(IndexError):
        mgr.evict("a", 0, [torch.tensor([5])] * H)
    with pytest.raises(ValueError):
        mgr.evict("a", 0, [torch.tensor([1])] * (H - 1))


def test_release_returns_every_page():
    pool, mgr = make()
    for s in "ab":
        mgr.open(s)
        fill(mgr, s, 7)
    mgr.release("a")
    assert pool.num_used == L * H * 2
    mgr.release("b")
    assert pool.num_free == pool.num_pages
    invariant(pool, mgr)


def test_fork_shares_pages_and_copies_on_write():
    pool, mgr = make()
    mgr.open("p")
    fill(mgr, "p", 6)  # last page half full
    used = pool.num_used
    mgr.fork("p", "c")
    assert pool.num_used == used  # nothing copied
    invariant(pool, mgr)
    # the child appends into its shared, partly filled last page: it gets its own copy
    slots = mgr.append(["c"], [1], torch.tensor([6]))
    mgr.pool.k.view(-1, D)[slots[0].reshape(-1)] = 777.0
    assert pool.num_used == used + L * H
    assert contents(mgr, "p", 0, 0)[1] == list(range(6))
    assert contents(mgr, "c", 0, 0) == ([float(i) for i in range(6)] + [777.0], list(range(7)))
    # evicting in the child never rewrites the parent's pages
    mgr.evict("c", 0, [torch.tensor([4, 5, 6])] * H)
    assert contents(mgr, "p", 0, 0) == ([float(i) for i in range(6)], list(range(6)))
    assert contents(mgr, "c", 0, 1) == ([104.0, 105.0, 777.0], [4, 5, 6])
    invariant(pool, mgr)
    mgr.release("p")
    mgr.release("c")
    assert pool.num_free == pool.num_pages


def test_snapshot_restore_round_trip():
    pool, mgr = make()
    mgr.open("a")
    fill(mgr, "a", 9)
    mgr.evict("a", 1, [torch.tensor([0, 8]), torch.arange(9), torch.tensor([2, 3, 4])])
    snap = mgr.snapshot("a")
    assert snap.num_tokens == 9 * H + 2 + 9 + 3
    mgr.release("a")
    mgr.restore("b", snap)
    for layer in range(L):
        for h in range(H):
            assert contents(mgr, "b", layer, h) == tuple(x for x in _snap_head(snap, layer, h))
    invariant(pool, mgr)


def _snap_head(snap, layer, head):
    cnt = snap.lengths.reshape(-1).long()
    i = layer * H + head
    a = int(cnt[:i].sum())
    b = a + int(cnt[i])
    return snap.k[a:b, 0].tolist(), snap.pos[a:b].tolist()


def test_eviction_copies_only_the_shared_pages_it_writes():
    pool, mgr = make()
    mgr.open("p")
    fill(mgr, "p", 12)  # 3 full pages per head
    mgr.fork("p", "c")
    used = pool.num_used
    # drop one token of the last page: only that page is rewritten, so only it is copied
    mgr.evict("c", 0, [torch.tensor([0, 1, 2, 3, 4, 5, 6, 7, 8, 10, 11])] * H)
    c_pages, p_pages = mgr.tables[mgr.slot("c"), 0], mgr.tables[mgr.slot("p"), 0]
    assert torch.equal(c_pages[:, :2], p_pages[:, :2])  # first two pages still shared
    assert not (c_pages[:, 2] == p_pages[:, 2]).any()
    assert pool.num_used == used + H
    assert contents(mgr, "p", 0, 0)[1] == list(range(12))
    assert contents(mgr, "c", 0, 0)[1] == [0, 1, 2, 3, 4, 5, 6, 7, 8, 10, 11]
    invariant(pool, mgr)


def test_fork_of_a_prefix_shares_its_full_pages():
    pool, mgr = make()
    mgr.open("holder")
    fill(mgr, "holder", 8)  # two full pages per head
    mgr.fork("holder", "s1", num_pages=1)
    mgr.fork("holder", "s2", num_pages=2)
    assert mgr.seq_lengths("s1").eq(P).all() and mgr.seq_lengths("s2").eq(2 * P).all()
    fill(mgr, "s1", 2, start=P)
    assert contents(mgr, "s1", 1, 2)[1] == [0, 1, 2, 3, P, P + 1]
    assert contents(mgr, "holder", 1, 2)[1] == list(range(8))
    assert pool.num_used == L * H * 2 + L * H  # the prefix once, plus s1's own page
    with pytest.raises(ValueError):
        mgr.fork("s1", "s3", num_pages=2)
    invariant(pool, mgr)
