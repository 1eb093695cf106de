"""PagedAttention: one forward pass's attention over the paged cache, with the methods' hooks.

The model calls ``attend(layer, q, k, v)`` for the batch's flattened tokens: decode tokens first
(one per sequence), then each sequence's prefill chunk. For every layer this

1. stores the new tokens' K/V in the pages the CacheManager reserved for them,
2. builds each call's AttentionView from the page tables and the methods' views,
3. runs the backend (batched decode; one call per prefill chunk), asking for attention
   probabilities only where a method needs them,
4. hands the results to the methods (after_decode / after_prefill_chunk), whose evictions are
   applied before the next layer runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable

import torch

from engine.cache.manager import CacheManager, ceil_div, to_device
from engine.cache.view import AttentionView
from engine.controller import SparseController
from engine.lifecycle import ChunkInfo, DecodeBatch, PrefillChunk, Selection


@dataclass
class PrefillSegment:
    seq_id: Hashable
    slot: int
    offset: int
    """Index of the chunk's first token in the flattened batch."""
    length: int
    start: int
    """Logical position of the chunk's first token."""
    is_last: bool
    context_lengths: torch.Tensor | None = None
    """``[L, H]`` (host) for a chunk of a method's scoring pass (the physical tokens before the
    pass): the backend returns every query's probabilities and the method observes them."""
    hooks: bool = True
    """False: the method sees nothing of this chunk (a token run again after a recall)."""


class PagedAttention:
    def __init__(
        self,
        manager: CacheManager,
        controller: SparseController,
        backend,
        scale: float,
        decode_ids: list[Hashable],
        decode_num_tokens: list[int],
        segments: list[PrefillSegment],
        slot_mapping: torch.Tensor,
        positions: torch.Tensor,
        query_windows: dict | None = None,
    ):
        self.manager = manager
        self.controller = controller
        self.backend = backend
        self.scale = scale
        self.decode_ids = decode_ids
        self.decode_num_tokens = decode_num_tokens
        self.segments = segments
        self.slot_mapping = slot_mapping  # [L, N, H]
        self.positions = positions  # [N] on device
        self.query_windows = query_windows or {}
        """seq_id -> QueryWindow: sessions whose recent queries are kept (they score pruning)."""
        self._recorded_rows = [(i, self.query_windows[s]) for i, s in enumerate(decode_ids) if s in self.query_windows]
        device = manager.device
        self._decode_slots = torch.tensor([manager.slot(s) for s in decode_ids], dtype=torch.long)
        self._decode_slots_dev = to_device(self._decode_slots, device)
        self._groups = controller.group(decode_ids) if decode_ids else []
        self._decode_probs = controller.decode_needs_probs(self._groups)

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        pool = self.manager.pool
        self.backend.store_kv(pool, self.slot_mapping[layer], k, v)
        out = torch.empty_like(q)
        B = len(self.decode_ids)
        if B:
            out[:B] = self._decode(layer, q[:B], k[:B])
        for seg in self.segments:
            s, e = seg.offset, seg.offset + seg.length
            out[s:e] = self._prefill(layer, seg, q[s:e], k[s:e], v[s:e])
            if seg.seq_id in self.query_windows:
                self.query_windows[seg.seq_id].push(layer, q[s:e])
        for i, window in self._recorded_rows:
            window.push(layer, q[i : i + 1])
        return out

    def _view(
        self, slots_host: torch.Tensor, slots_dev: torch.Tensor, layer: int, sel: Selection | None
    ) -> AttentionView:
        P = self.manager.page_size
        num_pages = int(ceil_div(int(self.manager.lengths[slots_host, layer].max()), P))
        tables, lengths = self.manager.view_tables(slots_dev, layer, max(num_pages, 1))
        view = AttentionView(tables, lengths, P)
        if sel is not None:
            view.selected_pages, view.token_mask = sel.selected_pages, sel.token_mask
        return view

    def _decode(self, layer: int, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        host_lengths = self.manager.lengths[self._decode_slots, layer]
        view = self._view(self._decode_slots, self._decode_slots_dev, layer, None)
        batch = DecodeBatch(
            layer=layer,
            seq_ids=self.decode_ids,
            num_tokens=self.decode_num_tokens,
            q=q,
            lengths=host_lengths,
            cache=self.manager,
            k=k,
            tables=view.tables,
            device_lengths=view.lengths,
        )
        parts = self.controller.decode_selections(layer, self._groups, batch)
        if parts:
            if self.controller.move_tiers(layer, parts, batch):  # offload / fetch changed the tables
                view = self._view(self._decode_slots, self._decode_slots_dev, layer, None)
            sel = self.controller.merge_selections(parts, batch)
            view.selected_pages, view.token_mask = sel.selected_pages, sel.token_mask
        out, probs = self.backend.decode(
            self.manager.pool,
            view,
            q,
            self.scale,
            want_probs=self._decode_probs and self.controller.decode_needs_probs_at(self._groups, layer),
        )
        batch.probs = probs
        self.controller.after_decode(layer, self._groups, batch)
        return out

    def _prefill(self, layer: int, seg: PrefillSegment, q, k, v) -> torch.Tensor:
        info = ChunkInfo(seq_id=seg.seq_id, layer=layer, start=seg.start, length=seg.length, is_last=seg.is_last)
        scoring = seg.context_lengths is not None
        window = seg.length if scoring else self.controller.prefill_probs_window(info)
        sel = self.controller.prefill_view(layer, info)
        slots = torch.tensor([seg.slot])
        view = self._view(slots, to_device(slots, self.manager.device), layer, sel)
        qpos = self.positions[seg.offset : seg.offset + seg.length]
        # quantized pages: the chunk attends its own K/V in full precision (KIVI's prefill), the
        # cached history dequantized
        chunk_kv = None if self.manager.pool.format.plain else (k, v)
        lengths = self.manager.lengths[seg.slot, layer]
        uniform = int(lengths[0]) if sel is None and bool((lengths == lengths[0]).all()) else None
        out, probs = self.backend.prefill(
            self.manager.pool, view, q, qpos, self.scale, probs_window=window, chunk_kv=chunk_kv, uniform_length=uniform
        )
        if not (scoring or (seg.hooks and self.controller.wants_after_prefill(seg.seq_id))):
            return out
        chunk = PrefillChunk(
            seq_id=seg.seq_id,
            layer=layer,
            start=seg.start,
            length=seg.length,
            is_last=seg.is_last and not scoring,  # a scoring pass's chunks end no turn's input
            q=q,
            k=k,
            v=v,
            probs=probs,
            lengths=self.manager.lengths[seg.slot, layer].clone(),
            cache=self.manager,
        )
        if scoring:
            chunk.context_lengths = seg.context_lengths[layer]
            self.controller.observe_scoring(layer, chunk)
        else:
            chunk.protected = self.controller.protected_len(seg.seq_id)
            self.controller.after_prefill_chunk(layer, chunk)
        return out
