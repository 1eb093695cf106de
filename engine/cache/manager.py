"""CacheManager: page tables per (sequence, layer, kv-head); append, evict, fork, snapshot.

Every cached sequence holds a *slot*. For each slot, layer and kv-head the manager keeps a page
list (``tables[slot, layer, head, :]``, -1 past the end) and a physical length
(``lengths[slot, layer, head]``): heads of one sequence may hold different numbers of tokens once a
method has evicted. Within a head, physical order is the order tokens arrived; eviction compacts
the kept tokens stably into the head's first pages and returns the rest to the pool, so a head
never holds more than one partly filled page.

Every (slot, layer) carries a *layout version* (``layout_versions``): a number that changes whenever
its pages are assigned or rewritten other than by appending (a new or forked sequence, a restored
snapshot, eviction's compaction, host-tier moves). State a method derives per physical page (quest's
key bounds) stays valid while the version it saw stays the same.

The host copy of the tables and lengths is authoritative: the scheduler reads it without a device
sync. On a GPU the manager writes every change to a device mirror too, which attention reads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable, Mapping, Sequence

import torch

from engine.cache.compaction import CompactionResult, compact, mask_from_indices
from engine.cache.pages import OutOfPages, PagePool
from engine.cache.transfer import ceil_div, to_device

Keep = "torch.Tensor | Sequence[torch.Tensor]"
"""Kept physical indices of one (sequence, layer): a ``[H, m]`` tensor or one 1-D tensor per head."""


@dataclass
class KVSnapshot:
    """A sequence's physical KV on the host: tokens listed layer by layer, head by head."""

    lengths: torch.Tensor  # [L, H] int32
    k: torch.Tensor  # [sum(lengths), D]
    v: torch.Tensor  # [sum(lengths), D]
    pos: torch.Tensor  # [sum(lengths)] int32

    @property
    def num_tokens(self) -> int:
        return int(self.lengths.sum())


class CacheManager:
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
        self._drop_host(slot)
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

    # --- append ---------------------------------------------------------------------------------
    def append(self, seq_ids: Sequence[Hashable], counts: Sequence[int], positions: torch.Tensor) -> torch.Tensor:
        """Make room for ``counts[i]`` new tokens in every head of ``seq_ids[i]``.

        Allocates pages (copying a shared partly filled last page first), advances the physical
        lengths, records the tokens' positions, and returns the slot mapping ``[L, N, H]`` (int64,
        on the pool's device): the flat pool index each new token's K/V goes to, N = sum(counts),
        tokens ordered sequence by sequence. Raises OutOfPages (changing nothing) if the pool is short.
        """
        P = self.page_size
        slots = torch.tensor([self.slot(s) for s in seq_ids])
        n_list = list(counts)
        n = torch.tensor(n_list, dtype=torch.int32)[:, None, None]
        old = self.lengths[slots]  # [B, L, H]
        new = old + n
        old_pages, new_pages = ceil_div(old, P), ceil_div(new, P)
        need = new_pages - old_pages
        shared = self._shared_partial(slots, old, n)
        total = int(need.sum()) + int(shared.sum())
        if int(new.max()) > self.max_pages * P:
            raise ValueError(f"a sequence would exceed max_model_len ({self.max_pages * P} tokens per head)")
        if total > self.pool.num_free:
            raise OutOfPages(f"append needs {total} pages, {self.pool.num_free} free")

        if bool(shared.any()):  # copy-on-write of the last, partly filled page
            b, l, h = shared.nonzero(as_tuple=True)
            p = ((old[b, l, h] - 1) // P).long()
            src = self.tables[slots[b], l, h, p].long()
            dst = self.pool.alloc(src.numel())
            self.pool.copy_pages(src, dst)
            self._set_pages(slots[b], l, h, p, dst)
            self.pool.decref(src)

        if total:
            b, l, h = (need > 0).nonzero(as_tuple=True)
            per = need[b, l, h].long()
            if per.numel():
                ids = self.pool.alloc(int(per.sum()))
                rows = torch.repeat_interleave(torch.arange(per.numel()), per)
                starts = torch.cumsum(per, 0) - per
                p = old_pages[b, l, h].long()[rows] + (torch.arange(ids.numel()) - starts[rows])
                self._set_pages(slots[b][rows], l[rows], h[rows], p, ids)

        self.lengths[slots] = new
        if self._mirrored:
            self.lengths_dev[to_device(slots, self.device)] = to_device(new, self.device)
        self._expire(slots, old, new)

        # slot mapping: token j of sequence b lands at physical index old[b, l, h] + j
        tok_b = torch.repeat_interleave(torch.arange(len(n_list)), torch.tensor(n_list))
        seq_start = torch.cumsum(torch.tensor(n_list), 0) - torch.tensor(n_list)
        tok_j = torch.arange(tok_b.numel()) - seq_start[tok_b]
        idx = old[tok_b].long() + tok_j[:, None, None]  # [N, L, H]
        page = self._table_entries(slots[tok_b], idx // P)
        flat = page.long() * P + idx % P
        flat_dev = to_device(flat, self.device)
        pos = to_device(positions.to(torch.int32), self.device)
        self.pool.pos.view(-1)[flat_dev.reshape(-1)] = pos[:, None, None].expand(flat.shape).reshape(-1)
        return flat_dev.permute(1, 0, 2).contiguous()

    def _expire(self, slots: torch.Tensor, old: torch.Tensor, new: torch.Tensor) -> None:
        """Tell a format with a full-precision window (KIVI's residual) which pages leave it as the
        heads of ``slots`` grow from ``old`` to ``new`` tokens (``[B, L, H]``): page j leaves it once
        its last token is ``residual_length`` or more tokens old, ``(j + 1) * P <= new - R``."""
        fmt = self.pool.format
        if not fmt.staging_per_head:
            return
        P, R = self.page_size, fmt.residual_length
        lo = (old - R).clamp(min=0) // P
        hi = (new - R).clamp(min=0) // P
        count = (hi - lo).clamp(min=0)
        if not bool(count.any()):
            return
        b, l, h = count.nonzero(as_tuple=True)
        per = count[b, l, h].long()
        rows = torch.repeat_interleave(torch.arange(per.numel()), per)
        j = lo[b, l, h].long()[rows] + torch.arange(int(per.sum())) - (torch.cumsum(per, 0) - per)[rows]
        pages = self.tables[slots[b][rows].long(), l[rows], h[rows], j].long()
        fmt.expire(pages, (j + 1) * P <= old[b, l, h].long()[rows])

    def _set_pages(self, slots: torch.Tensor, layers: torch.Tensor, heads: torch.Tensor, pages: torch.Tensor,
                   ids: torch.Tensor) -> None:
        self.tables[slots, layers, heads, pages] = ids.to(torch.int32)
        if self._mirrored:
            dev = self.device
            index = to_device(torch.stack([slots, layers, heads, pages]).long(), dev)
            self.tables_dev[index[0], index[1], index[2], index[3]] = to_device(ids.to(torch.int32), dev)

    # --- evict ---------------------------------------------------------------------------------
    def evict(self, seq_id: Hashable, layer: int, keep: Keep) -> int:
        """Keep only ``keep[h]`` (physical indices) in each head of one layer; free the rest."""
        return self.compact([(seq_id, layer, keep)]).pages_freed

    def evict_many(self, layer: int, items: Sequence[tuple[Hashable, Keep]]) -> int:
        """Evict in one layer of several sequences at once; returns the pages freed (net)."""
        return self.compact([(seq_id, layer, keep) for seq_id, keep in items]).pages_freed

    def compact(self, items: Sequence[tuple[Hashable, int, Keep]],
                protected: Mapping[Hashable, int] | None = None) -> CompactionResult:
        """Carry out keep decisions ``(seq_id, layer, keep)`` of any sequences and layers in one
        compaction (engine/cache/compaction.py). ``protected``: leading tokens of a sequence that
        every head keeps whatever its decision says (a shared prefix)."""
        H = self.num_kv_heads
        if len({(s, layer) for s, layer, _ in items}) != len(items):
            raise ValueError("compact got the same (sequence, layer) twice")
        if not items:
            return CompactionResult()
        pieces, slot_of_row, layer_of_row, prot = [], [], [], []
        for seq_id, layer, keep in items:
            slot = self.slot(seq_id)
            if self.num_host_pages(seq_id, layer):  # compaction rewrites pages: cold ones come back first
                self.recall(seq_id, layer)
            if isinstance(keep, torch.Tensor) and keep.dim() == 2:
                if keep.shape[0] != H:
                    raise ValueError(f"keep must give one index list per kv-head ({H}), got shape {tuple(keep.shape)}")
                pieces.extend(keep.unbind(0))
            elif not isinstance(keep, torch.Tensor) and len(keep) == H:
                pieces.extend(torch.as_tensor(k, dtype=torch.int64).reshape(-1) for k in keep)
            else:
                raise ValueError(f"keep must give one index list per kv-head ({H}), got {type(keep).__name__}")
            slot_of_row.append(slot)
            layer_of_row.append(layer)
            prot.append((protected or {}).get(seq_id, 0))
        n = len(items)
        slots = torch.tensor(slot_of_row).repeat_interleave(H)
        layers = torch.tensor(layer_of_row).repeat_interleave(H)
        heads = torch.arange(H).repeat(n)
        mask = mask_from_indices(pieces, self.lengths[slots, layers, heads], self.device)
        protect = torch.tensor(prot).repeat_interleave(H) if any(prot) else None
        return compact(self, slots, layers, heads, mask, protect)

    def compact_mask(self, slots: torch.Tensor, layers: torch.Tensor, heads: torch.Tensor, keep: torch.Tensor,
                     protect: torch.Tensor | None = None) -> CompactionResult:
        """The same with the decision as a keep mask ``[R, T]`` over rows (slot, layer, head)."""
        if getattr(self, "host_tables", None) is not None:
            seq_at = {s: q for q, s in self._slot_of.items()}
            for s, layer in {(int(s), int(layer)) for s, layer in zip(slots, layers)}:
                if self._cold[s, layer]:
                    self.recall(seq_at[s], layer)
        return compact(self, slots, layers, heads, keep, protect)

    def compact_seq(self, seq_id: Hashable, keep: torch.Tensor, protect: int = 0) -> CompactionResult:
        """Every layer and head of one sequence at once: ``keep`` ``[L, H, T]`` bool (device)."""
        s = self.slot(seq_id)
        L, H = self.num_layers, self.num_kv_heads
        slots = torch.full((L * H,), s)
        layers = torch.arange(L).repeat_interleave(H)
        heads = torch.arange(H).repeat(L)
        return self.compact_mask(slots, layers, heads, keep.reshape(L * H, -1),
                                 torch.full((L * H,), protect) if protect else None)

    def positions(self, seq_id: Hashable) -> torch.Tensor:
        """Original positions of a sequence's tokens, ``[L, H, T]`` (device; -1 past a head's end),
        T its longest head. Pages on the host tier come back to the device first."""
        s = self.slot(seq_id)
        if self._has_cold(s):
            for layer in range(self.num_layers):
                if self._cold[s, layer]:
                    self.recall(seq_id, layer)
        P, L, H = self.page_size, self.num_layers, self.num_kv_heads
        T = max(1, int(self.lengths[s].max()))
        npages = int(ceil_div(T, P))
        pages = self.tables_dev[s, :, :, :npages].long().clamp(min=0)
        pos = self.pool.pos[pages].reshape(L, H, npages * P)[..., :T]
        past = torch.arange(T, device=pos.device) >= self.lengths_dev[s][..., None]
        return pos.masked_fill(past, -1)

    def set_rows(self, slots: torch.Tensor, layers: torch.Tensor, heads: torch.Tensor, tables: torch.Tensor,
                 lengths: torch.Tensor) -> None:
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

    def truncate(self, seq_id: Hashable, lengths: torch.Tensor) -> int:
        """Cut every head of a sequence back to ``lengths`` ``[L, H]`` (its first tokens stay where
        they are: nothing moves, pages past the new ends are freed). Returns the pages freed."""
        s = self.slot(seq_id)
        old = self.lengths[s].long()
        new = torch.minimum(old, lengths.long())
        if bool((new == old).all()):
            return 0
        P = self.page_size
        table = self.tables[s].long()  # [L, H, MP]
        col = torch.arange(self.max_pages)
        tail = (col >= ceil_div(new, P)[..., None]) & (table >= 0)
        if bool(tail.any()) and self._has_cold(s):
            for layer in range(self.num_layers):
                if self._cold[s, layer]:
                    self.recall(seq_id, layer)
            table = self.tables[s].long()
            tail = (col >= ceil_div(new, P)[..., None]) & (table >= 0)
        freed = self.pool.decref(table[tail])
        table[tail] = -1
        L, H = self.num_layers, self.num_kv_heads
        self.set_rows(torch.full((L * H,), s), torch.arange(L).repeat_interleave(H), torch.arange(H).repeat(L),
                      table.reshape(L * H, -1).to(torch.int32), new.reshape(-1).to(torch.int32))
        return freed

    # --- fork ------------------------------------------------------------------------------------
    def fork(self, parent: Hashable, child: Hashable, num_pages: int | None = None) -> None:
        """``child`` shares ``parent``'s pages copy-on-write: all of them, or only each head's first
        ``num_pages`` full pages (a shared prefix; the parent's heads must hold at least that many)."""
        ps = self.slot(parent)
        for layer in range(self.num_layers):  # pages on the host are not shared: bring them back first
            if self.num_host_pages(parent, layer):
                self.recall(parent, layer)
        if num_pages is not None:
            have = self.lengths[ps]
            if int(have.min()) < num_pages * self.page_size:
                raise ValueError(f"{parent!r} holds fewer than {num_pages} full pages in some head")
        cs = self.open(child)
        if num_pages is None:
            self.tables[cs] = self.tables[ps]
            self.lengths[cs] = self.lengths[ps]
        else:
            self.tables[cs, :, :, :num_pages] = self.tables[ps, :, :, :num_pages]
            self.lengths[cs] = num_pages * self.page_size
        pages = self.tables[cs]
        self.pool.incref(pages[pages >= 0])
        if self._mirrored:
            self.tables_dev[cs] = self.tables[cs].to(self.device)
            self.lengths_dev[cs] = self.lengths[cs].to(self.device)

    # --- reading ---------------------------------------------------------------------------------
    def _flat_slots(self, slot: int, layer: int | None = None, tables: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
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

    def gather(self, seq_id: Hashable, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """One layer of a sequence as padded tensors: k, v ``[H, T, D]``, pos ``[H, T]`` (-1 past
        each head's end) and lengths ``[H]``, T the longest head. For methods that score the cache."""
        P = self.page_size
        s = self.slot(seq_id)
        lengths = self.lengths_dev[s, layer]
        T = int(self.lengths[s, layer].max())
        npages = ceil_div(T, P)
        pages = self.tables_dev[s, layer, :, :npages].long().clamp(min=0)
        D = self.pool.head_dim
        H = self.num_kv_heads
        k, v = self.pool.read_pages(pages)  # [H, npages, P, D], model dtype (quantized formats dequantize)
        pp = self.pool.pos[pages]
        if self.num_host_pages(seq_id, layer):  # offloaded pages: read them from the host tier
            cold = (self.tables[s, layer, :, :npages] < 0) & (self.host_tables[s, layer, :, :npages] >= 0)
            h, p = cold.nonzero(as_tuple=True)
            hk, hv, hpos = self.pool.host.read(self.host_tables[s, layer, h, p].long(), self.device)
            hd, pd = h.to(self.device), p.to(self.device)
            k[hd, pd], v[hd, pd], pp[hd, pd] = hk.to(k.dtype), hv.to(v.dtype), hpos
        k = k.reshape(H, npages * P, D)[:, :T]
        v = v.reshape(H, npages * P, D)[:, :T]
        pos = pp.reshape(H, npages * P)[:, :T].clone()
        pos.masked_fill_(torch.arange(T, device=pos.device)[None, :] >= lengths[:, None], -1)  # no mask indexing: no sync
        return k, v, pos, lengths

    def view_tables(self, slots: torch.Tensor, layer: int, num_pages: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Device page tables ``[B, H, num_pages]`` and lengths ``[B, H]`` of one layer for a batch."""
        return self.tables_dev[slots, layer, :, :num_pages], self.lengths_dev[slots, layer]

    # --- snapshot ----------------------------------------------------------------------------------
    def snapshot(self, seq_id: Hashable) -> KVSnapshot:
        s = self.slot(seq_id)
        flat, lengths = self._flat_slots(s)
        if self._has_cold(s):  # offloaded pages are read from the host tier
            return self._snapshot_tiers(s, flat, lengths)
        flat_d = flat.to(self.device)
        k, v = self.pool.read_tokens(flat_d)  # dequantized for quantized formats
        return KVSnapshot(lengths=lengths.clone(), k=k.cpu(), v=v.cpu(), pos=self.pool.pos.view(-1)[flat_d].cpu())

    def restore(self, seq_id: Hashable, snap: KVSnapshot) -> None:
        L, H = self.num_layers, self.num_kv_heads
        if tuple(snap.lengths.shape) != (L, H):
            raise ValueError(f"snapshot is for {tuple(snap.lengths.shape)} (layers, kv-heads); this model has {(L, H)}")
        if snap.k.shape[-1] != self.pool.head_dim or snap.k.shape[0] != snap.num_tokens:
            raise ValueError("snapshot K/V shapes do not match its lengths or this model's head_dim")
        if int(snap.lengths.max()) > self.max_pages * self.page_size:
            raise ValueError("snapshot holds more tokens per head than max_model_len allows")
        need = int(ceil_div(snap.lengths.long(), self.page_size).sum())
        if need > self.pool.num_free:
            raise OutOfPages(f"restore needs {need} pages, {self.pool.num_free} free")
        s = self.open(seq_id)
        per = ceil_div(snap.lengths.long(), self.page_size).reshape(-1)
        ids = self.pool.alloc(need)
        rows = torch.repeat_interleave(torch.arange(L * H), per)
        cols = torch.arange(need) - torch.repeat_interleave(torch.cumsum(per, 0) - per, per)
        self._set_pages(torch.full_like(rows, s), rows // H, rows % H, cols, ids)
        self.lengths[s] = snap.lengths.to(torch.int32)
        if self._mirrored:
            self.lengths_dev[s] = self.lengths[s].to(self.device)
        flat, _ = self._flat_slots(s)
        flat_d = flat.to(self.device)
        self._expire(torch.tensor([s]), torch.zeros_like(snap.lengths)[None], snap.lengths[None].to(torch.int32))
        self.pool.write_tokens(flat_d, snap.k.to(self.device, self.pool.dtype), snap.v.to(self.device, self.pool.dtype))
        self.pool.pos.view(-1)[flat_d] = snap.pos.to(self.device, torch.int32)

    # --- host tier (offload methods) ----------------------------------------------------------------
    # A page of a (sequence, layer, kv-head) is *resident* (``tables`` holds its device page), *cold*
    # (only ``host_tables`` holds it: the device page went back to the pool) or *hot* (both: fetched
    # back for reading; dropping it again costs no copy). Only full pages are offloaded, never the
    # page being written, so a host copy never goes stale. Pages shared with a fork or a shared
    # prefix stay on the device.
    @property
    def has_host_tier(self) -> bool:
        return self.pool.has_host

    def _host_tables(self) -> torch.Tensor:
        if getattr(self, "host_tables", None) is None:
            with torch.inference_mode(False):  # created mid-step, updated outside it too (release)
                self.host_tables = torch.full_like(self.tables, -1)
                self._cold = torch.zeros(self.max_seqs, self.num_layers, dtype=torch.int64)
        return self.host_tables

    def num_host_pages(self, seq_id: Hashable, layer: int) -> int:
        """Pages of one layer of a sequence that are on the host only (cold)."""
        if getattr(self, "host_tables", None) is None:
            return 0
        return int(self._cold[self.slot(seq_id), layer])

    def _has_cold(self, slot: int) -> bool:
        return getattr(self, "host_tables", None) is not None and bool(self._cold[slot].any())

    @staticmethod
    def _entries(page_lists: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        pl = torch.as_tensor(page_lists).long().reshape(page_lists.shape[0], -1)
        h, j = (pl >= 0).nonzero(as_tuple=True)
        return h, pl[h, j]

    def offload_pages(self, seq_id: Hashable, layer: int, page_lists: torch.Tensor) -> int:
        """Move pages (``[H, M]`` indices into each head's page list, -1 = none) to the host tier and
        return their device pages to the pool. Pages not on the device, the page being written and
        shared pages are skipped. Returns the device pages freed."""
        s = self.slot(seq_id)
        h, p = self._entries(page_lists)
        last = (self.lengths[s, layer, h].long() - 1) // self.page_size
        inside = p < last
        h, p = h[inside], p[inside]
        gpu = self.tables[s, layer, h, p].long()
        ok = gpu >= 0
        ok &= self.pool.refcount[gpu.clamp(min=0)] == 1
        h, p, gpu = h[ok], p[ok], gpu[ok]
        n = gpu.numel()
        if not n:
            return 0
        if not self.pool.format.plain:
            raise OutOfPages(f"offloading needs plain pages; this pool stores {self.pool.format.describe()} pages")
        ht = self._host_tables()
        host = ht[s, layer, h, p].long()
        new = host < 0
        if bool(new.any()):
            ids = self.pool.host.alloc(int(new.sum()))
            g = gpu[new].to(self.device)
            self.pool.host.write(ids, self.pool.k[g], self.pool.v[g], self.pool.pos[g])
            ht[s, layer, h[new], p[new]] = ids.to(torch.int32)
        self._set_pages(torch.full_like(h, s), torch.full_like(h, layer), h, p, torch.full_like(h, -1))
        self.pool.decref(gpu)
        self._cold[s, layer] += n
        self._bump(s, layer)
        return n

    def fetch_pages(self, seq_id: Hashable, layer: int, page_lists: torch.Tensor) -> int:
        """Copy cold pages among ``page_lists`` (``[H, K]``, -1 = none) back to new device pages
        (their host copies stay). Returns the pages fetched; raises OutOfPages if the pool is short."""
        s = self.slot(seq_id)
        if getattr(self, "host_tables", None) is None:
            return 0
        h, p = self._entries(page_lists)
        inside = p < ceil_div(self.lengths[s, layer, h].long(), self.page_size)
        h, p = h[inside], p[inside]
        cold = (self.tables[s, layer, h, p] < 0) & (self.host_tables[s, layer, h, p] >= 0)
        h, p = h[cold], p[cold]
        n = h.numel()
        if not n:
            return 0
        if n > self.pool.num_free:
            raise OutOfPages(f"fetching {n} offloaded pages, {self.pool.num_free} free")
        ids = self.pool.alloc(n)
        k, v, pos = self.pool.host.read(self.host_tables[s, layer, h, p].long(), self.device)
        d = ids.to(self.device)
        self.pool.k[d], self.pool.v[d], self.pool.pos[d] = k.to(self.pool.dtype), v.to(self.pool.dtype), pos
        self._set_pages(torch.full_like(h, s), torch.full_like(h, layer), h, p, ids)
        self._cold[s, layer] -= n
        self._bump(s, layer)
        return n

    def recall(self, seq_id: Hashable, layer: int) -> None:
        """Bring every cold page of one layer back to the device and drop the layer's host copies."""
        s = self.slot(seq_id)
        NP = self.max_pages
        self.fetch_pages(seq_id, layer, torch.arange(NP).expand(self.num_kv_heads, NP))
        ht = self.host_tables[s, layer]
        self.pool.host.free(ht[ht >= 0].long())
        ht.fill_(-1)

    def _drop_host(self, slot: int) -> None:
        if getattr(self, "host_tables", None) is None:
            return
        ht = self.host_tables[slot]
        if bool((ht >= 0).any()):
            self.pool.host.free(ht[ht >= 0].long())
            ht.fill_(-1)
        self._cold[slot] = 0

    def _snapshot_tiers(self, slot: int, flat: torch.Tensor, lengths: torch.Tensor) -> KVSnapshot:
        hflat, _ = self._flat_slots(slot, tables=self.host_tables)
        on = flat >= 0
        D = self.pool.head_dim
        host = self.pool.host
        k = torch.empty(flat.numel(), D, dtype=self.pool.dtype)
        v = torch.empty_like(k)
        pos = torch.empty(flat.numel(), dtype=torch.int32)
        dev = flat[on].to(self.device)
        k[on], v[on], pos[on] = self.pool.k.view(-1, D)[dev].cpu(), self.pool.v.view(-1, D)[dev].cpu(), self.pool.pos.view(-1)[dev].cpu()
        off = hflat[~on]
        k[~on], v[~on], pos[~on] = host.k.view(-1, D)[off], host.v.view(-1, D)[off], host.pos.view(-1)[off]
        return KVSnapshot(lengths=lengths.clone(), k=k, v=v, pos=pos)
