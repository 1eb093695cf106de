"""PageTables: the page list and physical length of every (sequence slot, layer, kv-head).

Every cached sequence holds a *slot*. For each slot, layer and kv-head the tables keep a page
list (``tables[slot, layer, head, :]``, -1 past the end) and a physical length
(``lengths[slot, layer, head]``): heads of one sequence may hold different numbers of tokens once a
method has evicted. The host copy is authoritative (the scheduler reads it without a device sync);
on a GPU every change is written to a device mirror too (``tables_dev``, ``lengths_dev``), which
attention reads.

Every (slot, layer) carries a *layout version* (``layout_versions``): a number that changes whenever
its pages are assigned or rewritten other than by appending (a new or forked sequence, a restored
snapshot, eviction's compaction, host-tier moves). State a method derives per physical page (quest's
key bounds) stays valid while the version it saw stays the same.
"""

from __future__ import annotations

from typing import Hashable, Sequence

import torch

from engine.cache.errors import OutOfPages
from engine.cache.pages import PagePool
from engine.cache.transfer import ceil_div, to_device


class PageTables:
    def __init__(self, pool: PagePool, num_layers: int, num_kv_heads: int, max_seqs: int, max_len: int):
        self.pool = pool
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.page_size = pool.page_size
        self.max_pages = ceil_div(max_len, pool.page_size)
        self.max_seqs = max_seqs
        shape = (max_seqs, num_layers, num_kv_heads)
        self.tables = torch.full(shape + (self.max_pages,), -1, dtype=torch.int32)
        self.lengths = torch.zeros(shape, dtype=torch.int32)
        self.device = pool.device
        self._mirrored = self.device.type != "cpu"
        self.tables_dev = self.tables.to(self.device) if self._mirrored else self.tables
        self.lengths_dev = self.lengths.to(self.device) if self._mirrored else self.lengths
        self._slot_of: dict[Hashable, int] = {}
        self._free_slots = list(range(max_seqs - 1, -1, -1))
        self._arange_l = torch.arange(num_layers)
        self._arange_h = torch.arange(num_kv_heads)
        self._versions = torch.zeros(max_seqs, num_layers, dtype=torch.int64)
        self._version_clock = 0
        self.evict_sink = None
        """Receives the tokens every compaction evicts before their pages are reused (the recall
        tier, engine/recall.py, sets itself here); None: evicted tokens are simply gone."""

    def _bump(self, slots, layer=None) -> None:
        """A new layout version for ``slots`` (an int or a tensor) in ``layer`` (None: every layer)."""
        self._version_clock += 1
        if layer is None:
            self._versions[slots] = self._version_clock
        else:
            self._versions[slots, layer] = self._version_clock

    def layout_versions(self, seq_ids: Sequence[Hashable], layer: int) -> list[int]:
        """The layout version of one layer of each sequence (see the module docstring)."""
        return self._versions[[self.slot(s) for s in seq_ids], layer].tolist()

    def layout_version_table(self, seq_ids: Sequence[Hashable]) -> list[list[int]]:
        """Every layer's layout version of each sequence, ``[len(seq_ids)][num_layers]``, in one read."""
        return self._versions[[self.slot(s) for s in seq_ids]].tolist()

    def page_table(self, seq_id: Hashable, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer's page ids ``[H, num_pages]`` (device, int64, -1 past a head's end or for a page
        on the host tier) and its lengths ``[H]`` (device), ``num_pages`` from the longest head."""
        s = self.slot(seq_id)
        num_pages = max(1, int(ceil_div(int(self.lengths[s, layer].max()), self.page_size)))
        return self.tables_dev[s, layer, :, :num_pages].long(), self.lengths_dev[s, layer]

    # --- sequences -----------------------------------------------------------------------------
    def open(self, seq_id: Hashable) -> int:
        if seq_id in self._slot_of:
            raise KeyError(f"sequence {seq_id!r} already has a cache")
        if not self._free_slots:
            raise OutOfPages(f"all {self.max_seqs} cache slots are taken")
        slot = self._free_slots.pop()
        self._slot_of[seq_id] = slot
        self._bump(slot)
        return slot

    def has(self, seq_id: Hashable) -> bool:
        return seq_id in self._slot_of

    def slot(self, seq_id: Hashable) -> int:
        try:
            return self._slot_of[seq_id]
        except KeyError:
            raise KeyError(f"sequence {seq_id!r} has no cache") from None

    @property
    def num_free_slots(self) -> int:
        return len(self._free_slots)

    def release(self, seq_id: Hashable) -> int:
        """Drop a sequence's cache; returns how many pages went back to the free list."""
        slot = self._slot_of.pop(seq_id)
        pages = self.tables[slot]
        freed = self.pool.decref(pages[pages >= 0])
        self.tables[slot] = -1
        self.lengths[slot] = 0
        if self._mirrored:
            self.tables_dev[slot] = -1
            self.lengths_dev[slot] = 0
        self._free_slots.append(slot)
        return freed

    # --- accounting ----------------------------------------------------------------------------
    def seq_lengths(self, seq_id: Hashable) -> torch.Tensor:
        """Physical tokens per (layer, kv-head), ``[L, H]`` int32 (host)."""
        return self.lengths[self.slot(seq_id)].clone()

    def pages_per_head(self, seq_id: Hashable) -> torch.Tensor:
        """Pages held per (layer, kv-head), ``[L, H]`` (host), from the page tables themselves."""
        return (self.tables[self.slot(seq_id)] >= 0).sum(-1)

    def num_pages(self, seq_id: Hashable) -> int:
        return int(self.pages_per_head(seq_id).sum())

    def kv_bytes(self, seq_id: Hashable) -> int:
        """Bytes of pool storage a sequence's pages hold, by the pool's accounting (shared pages
        counted in full): page storage plus the full-precision staging of its open pages."""
        pages = self.tables[self.slot(seq_id)]
        return self.pool.bytes_of(pages[pages >= 0])

    def pages_for_new(self, n: int) -> int:
        """Pages a new sequence of ``n`` tokens takes (every layer and kv-head holds them all)."""
        return self.num_layers * self.num_kv_heads * int(ceil_div(n, self.page_size))

    def pages_for_append(self, seq_ids: Sequence[Hashable], counts: Sequence[int]) -> int:
        """Pages that appending ``counts[i]`` tokens to every head of ``seq_ids[i]`` would take."""
        return int(self.pages_for_append_each(seq_ids, counts).sum()) if seq_ids else 0

    def pages_for_append_each(self, seq_ids: Sequence[Hashable], counts: Sequence[int]) -> torch.Tensor:
        """The same, per sequence (``[B]``), in one vectorised pass."""
        slots = torch.tensor([self.slot(s) for s in seq_ids], dtype=torch.long)
        n = torch.tensor(counts, dtype=torch.int32)[:, None, None]
        old = self.lengths[slots]
        need = ceil_div(old + n, self.page_size) - ceil_div(old, self.page_size)
        return (need + self._shared_partial(slots, old, n)).sum(dim=(1, 2))

    def _shared_partial(self, slots: torch.Tensor, old: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
        """[B, L, H]: heads whose partly filled last page is shared and is about to be written."""
        partial = (old % self.page_size != 0) & (n > 0)
        if not self.pool.has_shared or not bool(partial.any()):
            return partial & False
        last_idx = ((old - 1).clamp(min=0) // self.page_size).long()
        last = self._table_entries(slots, last_idx)
        return partial & (self.pool.refcount[last.clamp(min=0).long()] > 1)

    def _table_entries(self, slots: torch.Tensor, page_idx: torch.Tensor) -> torch.Tensor:
        """``tables[slots[b], l, h, page_idx[b, l, h]]`` as one flat gather (``[B, L, H]``); indexing
        ``tables[slots]`` instead would copy each slot's whole table."""
        L, H, M = self.num_layers, self.num_kv_heads, self.max_pages
        row = (slots.long()[:, None, None] * L + self._arange_l[None, :, None]) * H + self._arange_h[None, None, :]
        return self.tables.view(-1)[row * M + page_idx]

    def _set_pages(
        self, slots: torch.Tensor, layers: torch.Tensor, heads: torch.Tensor, pages: torch.Tensor, ids: torch.Tensor
    ) -> None:
        self.tables[slots, layers, heads, pages] = ids.to(torch.int32)
        if self._mirrored:
            dev = self.device
            index = to_device(torch.stack([slots, layers, heads, pages]).long(), dev)
            self.tables_dev[index[0], index[1], index[2], index[3]] = to_device(ids.to(torch.int32), dev)

    def set_rows(
        self,
        slots: torch.Tensor,
        layers: torch.Tensor,
        heads: torch.Tensor,
        tables: torch.Tensor,
        lengths: torch.Tensor,
    ) -> None:
        """Rewrite rows' page lists (their first ``tables.shape[1]`` entries) and lengths, on the host
        and the device mirror; the rows' layers get a new layout version."""
        width = tables.shape[1]
        self.tables[slots, layers, heads, :width] = tables
        self.lengths[slots, layers, heads] = lengths
        pairs = torch.unique(slots * self.num_layers + layers)
        self._version_clock += 1
        self._versions[pairs // self.num_layers, pairs % self.num_layers] = self._version_clock
        if self._mirrored:
            dev = self.device
            s_d, l_d, h_d = to_device(slots, dev), to_device(layers, dev), to_device(heads, dev)
            self.tables_dev[s_d, l_d, h_d, :width] = to_device(tables, dev)
            self.lengths_dev[s_d, l_d, h_d] = to_device(lengths, dev)

    def view_tables(self, slots: torch.Tensor, layer: int, num_pages: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Device page tables ``[B, H, num_pages]`` and lengths ``[B, H]`` of one layer for a batch."""
        return self.tables_dev[slots, layer, :, :num_pages], self.lengths_dev[slots, layer]

    def _flat_slots(
        self, slot: int, layer: int | None = None, tables: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Flat pool indices of every physical token of a slot (one layer or all), in (l, h, t) order
        (negative for a page not on the device; ``tables`` = ``host_tables`` indexes the host tier)."""
        P = self.page_size
        tables = self.tables if tables is None else tables
        lengths = self.lengths[slot] if layer is None else self.lengths[slot, layer][None]
        tables = tables[slot] if layer is None else tables[slot, layer][None]
        L, H = lengths.shape
        cnt = lengths.reshape(-1).long()
        row = torch.repeat_interleave(torch.arange(L * H), cnt)
        t = torch.arange(row.numel()) - torch.repeat_interleave(torch.cumsum(cnt, 0) - cnt, cnt)
        page = tables.reshape(L * H, -1)[row, t // P].long()
        return page * P + t % P, lengths
