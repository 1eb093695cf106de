"""The host tier's side of the CacheManager (a mixin): offloading cold pages and fetching them back.

A page of a (sequence, layer, kv-head) is *resident* (``tables`` holds its device page), *cold*
(only ``host_tables`` holds it: the device page went back to the pool) or *hot* (both: fetched
back for reading; dropping it again costs no copy). Only full pages are offloaded, never the
page being written, so a host copy never goes stale. Pages shared with a fork or a shared
prefix stay on the device.

The pages' host storage is the pool's HostTier (engine/cache/host_tier.py); ``host_tables`` (made
on first use) maps (slot, layer, head, page index) to a host page, like ``tables`` for the device.
"""

from __future__ import annotations

from typing import Hashable

import torch

from engine.cache.errors import OutOfPages
from engine.cache.fork_snapshot import KVSnapshot
from engine.cache.transfer import ceil_div


class HostTierOps:
    def release(self, seq_id: Hashable) -> int:
        """Drop a sequence's cache (its host pages too); returns how many device pages went back
        to the free list."""
        self._drop_host(self.slot(seq_id))
        return super().release(seq_id)

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
        k[on], v[on], pos[on] = (
            self.pool.k.view(-1, D)[dev].cpu(),
            self.pool.v.view(-1, D)[dev].cpu(),
            self.pool.pos.view(-1)[dev].cpu(),
        )
        off = hflat[~on]
        k[~on], v[~on], pos[~on] = host.k.view(-1, D)[off], host.v.view(-1, D)[off], host.pos.view(-1)[off]
        return KVSnapshot(lengths=lengths.clone(), k=k, v=v, pos=pos)
