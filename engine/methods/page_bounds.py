"""PageBounds: the element-wise min and max of every physical page's keys, kept beside the PagePool.

Quest scores a page by its key bounds. They are stored by *physical page id* (``lo``/``hi``
``[num_pages + 1, D]`` in the pool's dtype, so min/max of the keys are exact; row ``num_pages`` is a
scratch row that masked writes go to), once for the whole pool (``PagePool.derived``), so every
sequence and every layer shares one store, a fork shares its parent's bounds with its pages, and
a decode step of the whole batch reads them with one gather through the page tables. Memory:
``2 / page_size`` of the pool's K/V (about 6% at 32-token pages), allocated on first use.

Keeping them right, without a host sync:

* decode: the page each head is writing is recomputed from the pool itself every step (one page
  per head: the new key is already stored), so a page that starts, a copy-on-write copy of a
  shared partly filled page, or a page reused from another sequence never carries stale bounds;
  a page is final once full, because appends never rewrite a full page;
* prefill: after a chunk, the pages it touched are recomputed from the cache;
* anything else that assigns or rewrites a sequence's pages (a new, forked or restored sequence,
  eviction's compaction from pruning or rollback, host-tier moves) changes the CacheManager's
  *layout version* of that (sequence, layer). Each (sequence, layer) remembers the version its
  bounds were built at; a different one (checked on the host, one small lookup per layer)
  rebuilds all its pages from the cache before they are read. This is derived state: nothing to
  snapshot, and it is right whatever path changed the cache.
"""

from __future__ import annotations

from typing import Hashable, Sequence

import torch


class PageBounds:
    def __init__(self, pool):
        self.pool = pool
        self.page_size = pool.page_size
        self.scratch = pool.num_pages
        shape = (pool.num_pages + 1, pool.head_dim)
        with torch.inference_mode(False):  # created mid-step, written by hooks outside it too
            self.lo = torch.zeros(shape, dtype=pool.dtype, device=pool.device)
            self.hi = torch.zeros(shape, dtype=pool.dtype, device=pool.device)
        self._built: dict[Hashable, dict[int, int]] = {}
        """seq_id -> {layer: layout version its bounds were built at}."""

    @classmethod
    def of(cls, pool) -> "PageBounds":
        """The pool's one store (created on first use)."""
        return pool.derived("page_bounds", cls)

    def forget(self, seq_id: Hashable) -> None:
        self._built.pop(seq_id, None)

    # --- keeping them right ------------------------------------------------------------------------
    def ensure(self, cache, seq_ids: Sequence[Hashable], layer: int) -> None:
        """Rebuild the bounds of every page of ``layer`` for the sequences whose layout version
        changed since their bounds were built (host-side check; rare rebuilds)."""
        self.ensure_layers(cache, seq_ids, (layer,))

    def ensure_layers(self, cache, seq_ids: Sequence[Hashable], layers: Sequence[int]) -> None:
        """``ensure`` for several layers at once, the versions read in one lookup (before a graph replay)."""
        for seq_id, versions in zip(seq_ids, cache.layout_version_table(seq_ids)):
            built = self._built.setdefault(seq_id, {})
            for layer in layers:
                if built.get(layer) != versions[layer]:
                    ids, lengths = cache.page_table(seq_id, layer)
                    self._write(ids, lengths, 0)
                    built[layer] = versions[layer]

    def refresh(self, cache, seq_id: Hashable, layer: int, first_page: int) -> None:
        """Recompute pages ``first_page ..`` of one (sequence, layer) from the cache (after a prefill
        chunk); all of them if the layout changed since they were built."""
        built = self._built.get(seq_id, {})
        if built.get(layer) != cache.layout_versions([seq_id], layer)[0]:
            self.ensure(cache, [seq_id], layer)
            return
        ids, lengths = cache.page_table(seq_id, layer)
        self._write(ids[:, first_page:], lengths, first_page)

    def refresh_current(self, tables: torch.Tensor, lengths: torch.Tensor) -> None:
        """Recompute the page each head of each row is writing (``tables`` ``[B, H, NP]``, ``lengths``
        ``[B, H]`` on the device, the new token included): batched, no host sync."""
        last = lengths.long() - 1
        index = (last.clamp(min=0) // self.page_size).clamp(max=tables.shape[-1] - 1)
        page = tables.gather(-1, index[..., None]).squeeze(-1).long()  # [B, H]
        fill = last - index * self.page_size + 1
        self._store(page, fill, (last >= 0) & (page >= 0))

    def _write(self, ids: torch.Tensor, lengths: torch.Tensor, first_page: int) -> None:
        """Bounds of pages ``ids`` ``[H, n]`` (page ``first_page + j`` of each head) from the pool."""
        P = self.page_size
        start = (first_page + torch.arange(ids.shape[-1], device=ids.device)) * P
        fill = (lengths.to(ids.device).long()[:, None] - start[None, :]).clamp(0, P)
        self._store(ids, fill, (fill > 0) & (ids >= 0))

    def _store(self, page: torch.Tensor, fill: torch.Tensor, ok: torch.Tensor) -> None:
        keys = self.pool.k[page.clamp(min=0)]  # [..., P, D]
        valid = (torch.arange(self.page_size, device=keys.device) < fill[..., None])[..., None]
        lo = torch.where(valid, keys, float("inf")).amin(-2)
        hi = torch.where(valid, keys, float("-inf")).amax(-2)
        dst = torch.where(ok, page, self.scratch)  # masked rows land in the scratch row: no host sync
        self.lo[dst] = lo
        self.hi[dst] = hi

    # --- reading ------------------------------------------------------------------------------------
    def gather(self, tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The bounds (min, max) of every page of ``tables`` ``[B, H, NP]``: ``[B, H, NP, D]`` each
        (entries past a head's end are garbage: the caller masks them)."""
        ids = tables.long().clamp(min=0)
        return self.lo[ids], self.hi[ids]
