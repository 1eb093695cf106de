"""Compaction a chunk of rows at a time (engine/cache/compaction.py, ``COMPACTION_CHUNK_BYTES``):
a batch's compaction keeps the same tokens and frees the same pages as one carried out at once, in
every page format, forks (copy-on-write) included; and its working memory stays under the chunk
budget however large the batch grows, forks of one prompt that all rewrite a shared page included
(engine/cache/compaction_plan.py). No model: fast."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import engine.cache.compaction as compaction
from engine.cache.errors import OutOfPages
from engine.cache.formats import make_format
from engine.cache.manager import CacheManager
from engine.cache.pages import PagePool

L, H, D, P = 2, 2, 32, 8
CPU = torch.device("cpu")
FORMATS = [
    ("plain", ()),
    ("fp8", ()),
    ("kivi", (("bits", 4), ("residual_length", 0))),
    ("kivi", (("bits", 2), ("residual_length", 16))),
]


def make(fmt: str, args, num_seqs: int):
    f = make_format(fmt, dict(args), P, D, torch.float32)
    num_pages = num_seqs * L * H * (128 // P + 2)
    pool = PagePool(num_pages, P, D, torch.float32, CPU, format=f, max_open_pages=num_seqs * L * H * f.staging_per_head)
    return pool, CacheManager(pool, L, H, num_seqs, 256)


def fill(mgr: CacheManager, seq, n: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    slots = mgr.append([seq], [n], torch.arange(n))
    for layer in range(L):
        mgr.pool.write_tokens(slots[layer], torch.randn(n, H, D, generator=g), torch.randn(n, H, D, generator=g))


def batch(fmt: str, args, num_seqs: int, forks: int = 0, one_parent: bool = False):
    """``num_seqs`` sequences of 60..127 tokens (the last ``forks`` of them forks of the first ones,
    or all of sequence 0 with ``one_parent``, each grown past the fork by its own tokens)."""
    pool, mgr = make(fmt, args, num_seqs)
    for i in range(num_seqs - forks):
        mgr.open(i)
        fill(mgr, i, 60 + (i * 37) % 68, seed=i)
    for j in range(forks):
        child = num_seqs - forks + j
        mgr.fork(0 if one_parent else j, child)
        n = int(mgr.lengths[mgr.slot(child)].max())
        slots = mgr.append([child], [5], torch.arange(n, n + 5))
        g = torch.Generator().manual_seed(1000 + j)
        for layer in range(L):
            pool.write_tokens(slots[layer], torch.randn(5, H, D, generator=g), torch.randn(5, H, D, generator=g))
    return pool, mgr


def decisions(mgr: CacheManager, seqs, seed: int = 0):
    """Rows (slot, layer, head) of every sequence, and a keep mask mixing a streaming window (sink +
    recent), random keeps, an untouched row and a truncation."""
    slots = torch.tensor([mgr.slot(s) for s in seqs]).repeat_interleave(L * H)
    layers = torch.arange(L).repeat_interleave(H).repeat(len(seqs))
    heads = torch.arange(H).repeat(len(seqs) * L)
    n = mgr.lengths[slots, layers, heads].long()
    T = int(n.max())
    t = torch.arange(T)
    g = torch.Generator().manual_seed(seed)
    keep = (t < 4) | (t >= n[:, None] - 40)  # sink + window: everything after the gap moves
    rnd = torch.rand(len(n), T, generator=g) < 0.5
    keep[1::3] = rnd[1::3]
    keep[2::7] = True  # nothing evicted
    keep[5::11] = t < 9  # a truncation: nothing moves
    protect = torch.zeros(len(n), dtype=torch.long)
    protect[::5] = 6
    return slots, layers, heads, keep, protect


def state(pool: PagePool, mgr: CacheManager, seqs):
    out = {}
    for s in seqs:
        for layer in range(L):
            k, v, pos, lengths = mgr.gather(s, layer)
            for h in range(H):
                n = int(lengths[h])
                out[s, layer, h] = (k[h, :n].clone(), v[h, :n].clone(), pos[h, :n].clone())
    free = sorted(pool._free[: pool.num_free].tolist())
    return out, free, pool.refcount.clone()


def same_pages_up_to_ids(a: CacheManager, b: CacheManager) -> None:
    """The two managers' tables use their pages alike: a one-to-one renaming of page ids takes one's
    tables and reference counts to the other's, and as many pages are free."""
    held = a.tables >= 0
    assert torch.equal(held, b.tables >= 0)
    pairs = torch.stack([a.tables[held].long(), b.tables[held].long()], 1).unique(dim=0)
    assert pairs[:, 0].unique().numel() == pairs[:, 1].unique().numel() == len(pairs)  # a bijection
    assert torch.equal(a.pool.refcount[pairs[:, 0]], b.pool.refcount[pairs[:, 1]])
    assert a.pool.num_free == b.pool.num_free


def compact_all(monkeypatch, fmt, args, budget, forks, one_parent=False):
    monkeypatch.setattr(compaction, "COMPACTION_CHUNK_BYTES", budget)
    pool, mgr = batch(fmt, args, 12, forks, one_parent)
    seqs = list(range(12))
    result = mgr.compact_mask(*decisions(mgr, seqs))
    return result, state(pool, mgr, seqs), mgr


@pytest.mark.parametrize("forks,one_parent", [(0, False), (3, False), (8, True)])
@pytest.mark.parametrize("fmt,args", FORMATS)
def test_chunked_compaction_keeps_and_frees_what_one_compaction_does(monkeypatch, fmt, args, forks, one_parent):
    """Forked rows too move a chunk at a time (``one_parent``: 9 rows of each layer and head share the
    parent's first page, which all of them rewrite: one group larger than the budget). A chunk may
    copy a page that one compaction would have written in place (compaction_plan.py), so with forks
    the page ids may differ; how the pages are used may not."""
    whole, (kv_whole, free_whole, refs_whole), mgr_whole = compact_all(
        monkeypatch, fmt, args, 1 << 40, forks, one_parent
    )
    chunks = []
    real = compaction._move
    monkeypatch.setattr(compaction, "_move", lambda m, k, idx, rows: (chunks.append(len(idx)), real(m, k, idx, rows)))
    small, (kv_small, free_small, refs_small), mgr = compact_all(monkeypatch, fmt, args, 4096, forks, one_parent)
    assert len(chunks) > 10 and max(chunks) <= 2  # really carried out in chunks, forked rows too
    assert whole.tokens_removed > 0 and (whole.pages_freed > 0 or one_parent)  # 8 forks copy more than they free
    assert (small.pages_freed, small.tokens_removed) == (whole.pages_freed, whole.tokens_removed)
    same_pages_up_to_ids(mgr, mgr_whole)
    if not forks:  # nothing copied: the very same pages
        assert free_small == free_whole and torch.equal(refs_small, refs_whole)
    assert kv_small.keys() == kv_whole.keys()
    for key, (k, v, pos) in kv_whole.items():
        ks, vs, ps = kv_small[key]
        assert torch.equal(ks, k) and torch.equal(vs, v) and torch.equal(ps, pos), key
    t = mgr.tables[mgr.tables >= 0].long()  # every page is referenced as often as its count says
    assert torch.equal(torch.bincount(t, minlength=mgr.pool.num_pages).to(torch.int32), refs_small)


class LargestAllocation(TorchDispatchMode):
    """The largest tensor any op allocates while active (outputs that are not a view or an in-place
    update of an input)."""

    def __init__(self):
        super().__init__()
        self.sizes = [0]

    @property
    def largest(self) -> int:
        return max(self.sizes)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {x.untyped_storage().data_ptr() for x in tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)}
        for x in tree_leaves(out):
            if isinstance(x, torch.Tensor) and x.untyped_storage().data_ptr() not in inputs:
                self.sizes.append(x.untyped_storage().nbytes())
        return out


@pytest.mark.parametrize("fmt,args", FORMATS[:3])
def test_compaction_working_memory_stays_under_the_chunk_budget_as_the_batch_grows(monkeypatch, fmt, args):
    budget = 64 << 10
    monkeypatch.setattr(compaction, "COMPACTION_CHUNK_BYTES", budget)
    largest = {}
    for num_seqs in (2, 8, 32):
        pool, mgr = batch(fmt, args, num_seqs)
        seqs = list(range(num_seqs))
        slots, layers, heads, keep, protect = decisions(mgr, seqs)
        moved, take = [], pool.format.take_tokens
        monkeypatch.setattr(pool.format, "take_tokens", lambda src: (moved.append(src.numel()), take(src))[1])
        with LargestAllocation() as mem:
            result = mgr.compact_mask(slots, layers, heads, keep, protect)
        moved_bytes = sum(moved) * 2 * D * 4
        assert result.tokens_removed > 0
        largest[num_seqs] = mem.largest
        if num_seqs == 32:  # the batch's moved K/V alone is many budgets: only chunks fit
            assert moved_bytes > 4 * budget
    assert max(largest.values()) <= budget, largest


def test_streaming_llm_decode_mask_built_a_few_sequences_at_a_time(monkeypatch):
    """streaming_llm's batch-wide keep mask (sink + recent window of every due head) is written in place a
    chunk of sequences at a time; it is the rule's mask, and its temporaries stay within the budget."""
    import engine.methods.streaming_llm as streaming
    from engine.lifecycle import ModelShape, SeqInfo
    from engine.method_spec import MethodSpec

    shape = ModelShape(num_layers=L, num_heads=4, num_kv_heads=H, head_dim=D, page_size=P)
    m = streaming.StreamingLLM(MethodSpec("streaming_llm", budget=20, method_args={"slack": 3, "n_sink": 4}), shape)
    g = torch.Generator().manual_seed(0)
    seqs = [SeqInfo(i, 100, protected_len=5 * (i % 2)) for i in range(24)]
    lengths = torch.randint(10, 40, (24, L, H), generator=g)
    budget = 8 * L * H * 40  # about a third of the mask
    monkeypatch.setattr(streaming, "COMPACTION_CHUNK_BYTES", budget)
    with LargestAllocation() as mem:
        decided = m.after_decode_step(seqs, lengths)
    sizes = sorted(mem.sizes)
    assert sizes[-1] == decided.mask.numel() and sizes[-2] <= budget  # the mask itself, then its temporaries
    due = (lengths.amax(dim=(1, 2)) > 20 + torch.tensor([s.protected_len for s in seqs])).nonzero().flatten()
    assert decided.seq_ids == due.tolist() and len(due) > 8
    t = torch.arange(decided.mask.shape[-1])
    n = lengths[due][..., None]
    assert torch.equal(decided.mask, (t < 4) | ((t >= n - 16) & (t < n)))


@pytest.mark.parametrize("one_parent", [False, True])
def test_forked_rows_compaction_working_memory_stays_under_the_budget_as_the_forks_grow(monkeypatch, one_parent):
    """Half the batch are forks (of their own parents, or all of sequence 0: then every row of a
    layer and head rewrites the one shared first page, a group far past the budget); the largest
    allocation stays under the budget while the forked rows and their moved tokens grow."""
    budget = 64 << 10
    monkeypatch.setattr(compaction, "COMPACTION_CHUNK_BYTES", budget)
    largest = {}
    for num_seqs in (4, 16, 48):
        pool, mgr = batch("plain", (), num_seqs, num_seqs // 2, one_parent)
        seqs = list(range(num_seqs))
        slots, layers, heads, keep, protect = decisions(mgr, seqs)
        forked = slots >= mgr.slot(num_seqs - num_seqs // 2)
        moved, take = [], pool.format.take_tokens
        monkeypatch.setattr(pool.format, "take_tokens", lambda src: (moved.append(src.numel()), take(src))[1])
        copied, copy = [], pool.copy_pages
        monkeypatch.setattr(pool, "copy_pages", lambda src, dst: (copied.append(src.numel()), copy(src, dst))[1])
        with LargestAllocation() as mem:
            result = mgr.compact_mask(slots, layers, heads, keep, protect)
        assert result.tokens_removed > 0 and sum(copied) >= int(forked.sum()) // 2  # forks really rewrite shared pages
        largest[num_seqs] = mem.largest
        if num_seqs == 48:  # the batch's moved K/V alone is many budgets: only chunks fit
            assert sum(moved) * 2 * D * 4 > 8 * budget
    assert max(largest.values()) <= budget, largest


def test_compaction_short_of_copy_on_write_pages_changes_nothing():
    """Forks that must copy their shared pages, with no page free: refused before any row moves
    (the plan's page accounting is replayed first), whatever the tails would free later."""
    pool, mgr = batch("plain", (), 12, 8, one_parent=True)
    seqs = list(range(12))
    decided = decisions(mgr, seqs)
    pool.alloc(pool.num_free)
    before = state(pool, mgr, seqs)
    tables = mgr.tables.clone()
    with pytest.raises(OutOfPages):
        mgr.compact_mask(*decided)
    after = state(pool, mgr, seqs)
    assert torch.equal(mgr.tables, tables) and after[1] == before[1] and torch.equal(after[2], before[2])
    for key, (k, v, pos) in before[0].items():
        assert all(torch.equal(x, y) for x, y in zip(after[0][key], (k, v, pos))), key
