"""CacheManager: a sequence's KV pages per (layer, kv-head): append, evict, fork, snapshot, offload.

The manager is assembled from one module per concern:

``page_tables.py``    slots, page lists, lengths, layout versions, page accounting (``PageTables``)
``compaction.py``     keep decisions carried out as one compaction (``CompactionOps``)
``fork_snapshot.py``  copy-on-write forks, host snapshots and their restore (``ForkSnapshotOps``)
``offload.py``        pages moved to the host tier and fetched back (``HostTierOps``)

and this file: appending new tokens, truncating, and reading a sequence's cache back (positions,
padded K/V for methods that score it). Within a head, physical order is the order tokens arrived;
eviction compacts the kept tokens stably into the head's first pages and returns the rest to the
pool, so a head never holds more than one partly filled page.
"""

from __future__ import annotations

from typing import Hashable, Sequence

import torch

from engine.cache.compaction import CompactionOps, Keep
from engine.cache.errors import OutOfPages
from engine.cache.fork_snapshot import ForkSnapshotOps, KVSnapshot
from engine.cache.offload import HostTierOps
from engine.cache.page_tables import PageTables
from engine.cache.transfer import ceil_div, to_device

__all__ = ["CacheManager", "KVSnapshot", "Keep", "ceil_div", "to_device"]


class CacheManager(HostTierOps, CompactionOps, ForkSnapshotOps, PageTables):
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
        self.set_rows(
            torch.full((L * H,), s),
            torch.arange(L).repeat_interleave(H),
            torch.arange(H).repeat(L),
            table.reshape(L * H, -1).to(torch.int32),
            new.reshape(-1).to(torch.int32),
        )
        return freed

    # --- reading ---------------------------------------------------------------------------------
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
        pos.masked_fill_(
            torch.arange(T, device=pos.device)[None, :] >= lengths[:, None], -1
        )  # no mask indexing: no sync
        return k, v, pos, lengths
