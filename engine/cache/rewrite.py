"""Rewriting rows: a new token list for some (sequence slot, layer, kv-head) rows, written into fresh pages.

Compaction can only keep a subset of a row's tokens in place; the recall tier (engine/recall.py)
also brings tokens back, which land *between* the tokens a head holds (a row stays sorted by
position, so physical order is still arrival order). ``rewrite_rows`` takes each row's whole new
content, already gathered into temporary tensors, keeps the row's first ``keep_pages`` pages as
they are (a shared prefix's pages stay shared), returns the rest of its pages to the pool and
writes the content from ``keep_pages * page_size`` on into new pages. It refuses, changing
nothing, when the pool cannot hold the result.
"""

from __future__ import annotations

import torch

from engine.cache.errors import OutOfPages
from engine.cache.transfer import ceil_div, to_device


def rewrite_rows(
    manager,
    slots: torch.Tensor,
    layers: torch.Tensor,
    heads: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    pos: torch.Tensor,
    lengths: torch.Tensor,
    keep_pages: torch.Tensor,
) -> int:
    """Rows ``(slots[r], layers[r], heads[r])`` (host int64 ``[R]``) become ``k``/``v`` ``[R, T, D]``,
    ``pos`` ``[R, T]`` (device) cut at ``lengths`` ``[R]`` (host); their first ``keep_pages[r]`` pages
    (host, whose tokens must equal the content's first ones) stay. Returns the pages the rows hold
    now minus before (negative: pages freed)."""
    pool, P = manager.pool, manager.page_size
    R = int(slots.numel())
    if R == 0:
        return 0
    if not pool.format.plain:
        raise OutOfPages(f"rewriting rows needs plain pages; this pool stores {pool.format.describe()} pages")
    old = manager.lengths[slots, layers, heads].long()
    new = lengths.long()
    if int(new.max()) > manager.max_pages * P:
        raise ValueError(f"a rewritten row would exceed max_model_len ({manager.max_pages * P} tokens per head)")
    keep = torch.minimum(keep_pages.long(), torch.minimum(new // P, old // P))
    width = max(1, int(ceil_div(torch.maximum(old, new), P).max()))
    table = manager.tables[slots, layers, heads, :width].long()
    col = torch.arange(width)[None, :]
    drop = (col >= keep[:, None]) & (col < ceil_div(old, P)[:, None]) & (table >= 0)
    fresh = (col >= keep[:, None]) & (col < ceil_div(new, P)[:, None])
    sole = drop & (pool.refcount[table.clamp(min=0)] == 1)
    if int(fresh.sum()) > pool.num_free + int(sole.sum()):
        raise OutOfPages(f"rewriting needs {int(fresh.sum())} pages, {pool.num_free} free")
    before = pool.num_free
    pool.decref(table[drop])
    new_table = torch.where(col < keep[:, None], table, -1)
    new_table[fresh] = pool.alloc(int(fresh.sum()))
    # tokens from each row's first rewritten page on
    t = torch.arange(k.shape[1])[None, :]
    write = (t >= (keep * P)[:, None]) & (t < new[:, None])
    r, tt = write.nonzero(as_tuple=True)
    dev = manager.device
    r_d, tt_d = to_device(r, dev), to_device(tt, dev)
    dst = to_device(new_table, dev)[r_d, tt_d // P] * P + tt_d % P
    pool.format.write(dst, k[r_d, tt_d], v[r_d, tt_d])
    pool.pos.view(-1)[dst] = pos[r_d, tt_d].to(torch.int32)
    manager.set_rows(slots, layers, heads, new_table.to(torch.int32), new.to(torch.int32))
    return before - pool.num_free
