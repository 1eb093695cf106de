"""Fork and snapshot of a sequence's KV (CacheManager mixin).

``fork`` shares a sequence's pages copy-on-write with a new one (all of them, or a shared
prefix's full pages). ``snapshot`` copies a sequence's physical KV to the host (``KVSnapshot``:
tokens layer by layer, head by head; offloaded pages are read from the host tier) and ``restore``
writes one back into fresh pages.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable

import torch

from engine.cache.errors import OutOfPages
from engine.cache.transfer import ceil_div


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


class ForkSnapshotOps:
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
