"""Compaction: keep a subset of each head's tokens, packed into the head's first pages, free the rest.

One compaction serves any number of *rows* at once, a row being one (sequence slot, layer, kv-head)
of the CacheManager: every layer's decisions of every sequence in a forward pass, a whole session
at a turn's end, a pruned span across all layers. Its cost does not grow with the number of calls
a caller would otherwise make, so callers gather decisions and compact once:

* a keep mask ``[R, T]`` (bool, on the pool's device) says which physical tokens of each row stay;
  a row's first ``protect[r]`` tokens always stay (a shared prefix);
* one small device -> host copy brings back each row's kept count and its *leading run* (the
  tokens before the first evicted one, which do not move); everything else the host decides from
  the counts alone: the new lengths, the pages past each row's new end (freed), and the pages
  the move writes that another owner still reads (copied first: copy-on-write);
* the kept tokens at or after the leading run move to index ``j`` (their rank among the row's
  kept tokens) in one gather and one scatter on the device, so physical order stays arrival order.

Keep decisions given as index lists (a method's top-k) become a mask with
:func:`mask_from_indices`; index lists on the host are checked against the rows' lengths, those on
the device are trusted (an index outside a row is dropped, never read).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable, Mapping, Sequence, Union

import torch

from engine.cache.compaction_plan import RowPages, Rows, check_pages, chunks, sharing_groups
from engine.cache.transfer import to_device


Keep = Union[torch.Tensor, Sequence[torch.Tensor]]
"""A keep decision for one (sequence, layer): the physical indices each kv-head keeps, as a ``[H, m]``
tensor or one 1-D tensor per head (host or device)."""


@dataclass
class CompactionResult:
    pages_freed: int = 0
    """Pages back on the free list, net of copy-on-write copies."""
    tokens_removed: int = 0
    """Physical tokens dropped, summed over rows."""


def mask_from_indices(pieces: Sequence[torch.Tensor], lengths: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``[R, T]`` keep mask from one 1-D index tensor per row (``T`` = the longest row, ``lengths``
    ``[R]`` host int). Host pieces are checked (IndexError for an index outside its row); device
    pieces reach the mask without a host sync."""
    R = len(pieces)
    T = max(1, int(lengths.max())) if R else 1
    counts = [int(p.numel()) for p in pieces]
    total = sum(counts)
    mask = torch.zeros(R, T + 1, dtype=torch.bool, device=device)  # column T collects dropped indices
    if total == 0:
        return mask[:, :T]
    on_host = [i for i, p in enumerate(pieces) if p.device.type == "cpu"]
    if on_host:
        flat = torch.cat([pieces[i].reshape(-1).to(torch.int64) for i in on_host])
        row = torch.repeat_interleave(torch.tensor(on_host), torch.tensor([counts[i] for i in on_host]))
        bad = (flat < 0) | (flat >= lengths[row].long())
        if bool(bad.any()):
            r = int(row[bad][0])
            raise IndexError(f"keep index {int(flat[bad][0])} is outside row {r} (length {int(lengths[r])})")
        _set(mask, row, flat, device)
    on_dev = [i for i in range(R) if pieces[i].device.type != "cpu"]
    if on_dev:
        flat = torch.cat([pieces[i].reshape(-1).to(torch.int64) for i in on_dev])
        row = to_device(
            torch.repeat_interleave(torch.tensor(on_dev), torch.tensor([counts[i] for i in on_dev])), flat.device
        )
        limit = to_device(lengths.to(torch.int64), flat.device)[row]
        flat = torch.where((flat >= 0) & (flat < limit), flat, T)  # outside its row: dropped
        _set(mask, row, flat, device)
    return mask[:, :T]


def _set(mask: torch.Tensor, row: torch.Tensor, col: torch.Tensor, device) -> None:
    mask[to_device(row, mask.device), to_device(col, mask.device)] = True


COMPACTION_CHUNK_BYTES = 512 << 20
"""Working memory a compaction takes at a time on the pool's device: its rows are carried out in
chunks whose masks, indices and moved tokens fit in this (at least one row a chunk), so a batch's
compaction needs no more temporary memory however large the batch, forks sharing pages included
(engine/cache/compaction_plan.py: rows that share written pages move in whole groups where a group
fits, a chunk at a time where it does not). Gathering every moved token of a batch at once asked for
52 GiB (425 streaming_llm sessions of Llama-3.1-8B at a 2,048 budget)."""

_CELL_BYTES = 32
"""Working memory per token position of a chunk's rows: the clipped mask, its int64 ranks and
comparisons, and the rows' page tables and page masks (fewer entries than positions)."""

_INDEX_BYTES = 96
"""Working memory per moved token besides its K/V (``KVFormat.moved_token_bytes``): its source and
destination slots, row, column and rank (int64)."""


def compact(
    manager,
    slots: torch.Tensor,
    layers: torch.Tensor,
    heads: torch.Tensor,
    keep: torch.Tensor,
    protect: torch.Tensor | None = None,
) -> CompactionResult:
    """Keep ``keep[r]`` of row ``(slots[r], layers[r], heads[r])`` (host int64 ``[R]`` each, rows
    distinct, none with pages on the host tier; ``keep`` ``[R, T]`` bool on the pool's device, ``T``
    at least the longest row). ``protect`` ``[R]`` (host): leading tokens each row keeps whatever
    the mask says. Carried out a chunk of rows at a time (``COMPACTION_CHUNK_BYTES``)."""
    pool = manager.pool
    R = int(slots.numel())
    if R == 0:
        return CompactionResult()
    old = manager.lengths[slots, layers, heads].long()
    T = keep.shape[1]
    if int(old.max()) > T:
        raise ValueError(f"the keep mask covers {T} tokens; a row holds {int(old.max())}")
    if protect is not None and not bool((protect > 0).any()):
        protect = None
    rows = Rows(slots, layers, heads, old, None if protect is None else protect.long())
    budget, row_bytes = COMPACTION_CHUNK_BYTES, T * _CELL_BYTES
    every_row = torch.full((R,), row_bytes)

    # each row's kept count and leading run (the tokens before its first evicted one, which stay
    # put): chunk by chunk on the device, then the one device -> host copy
    parts = []
    for a, b in chunks(every_row, budget):
        k = _clipped(keep[a:b], rows[a:b])
        parts.append(torch.stack([k.sum(1), (~k).int().cumsum(1).eq(0).sum(1)]))
    stats = torch.cat(parts, 1).cpu()
    rows.new, rows.lead = stats[0], stats[1].minimum(old)
    changed = (rows.new < old).nonzero().flatten()
    if changed.numel() == 0:
        return CompactionResult()

    # the rows that write a page another owner reads (copy-on-write, or a page another row's freed
    # tail holds) and the pages they write so: those rows move after the others, grouped with the
    # rows they share those pages with (engine/cache/compaction_plan.py says why that is safe)
    copies = torch.zeros(changed.numel(), dtype=torch.long)
    linked = torch.zeros(pool.num_pages, dtype=torch.bool)
    for a, b in chunks(every_row[changed], budget):
        pages = RowPages(manager, rows[changed[a:b]])
        copies[a:b] = pages.written_shared.sum(1)
        linked[pages.table[pages.written_shared]] = True
    shares = copies > 0
    cost = row_bytes + (rows.new - rows.lead)[changed] * (pool.format.moved_token_bytes + _INDEX_BYTES)
    cost += copies * pool.format.bytes_per_page  # the page copies
    own = changed[~shares]  # rows that write only pages of their own: no other row reads those pages
    plan = [own[a:b] for a, b in chunks(cost[~shares], budget)]
    if bool(shares.any()):
        plan += sharing_groups(manager, rows, changed[shares], linked, cost[shares], budget)
        check_pages(manager, rows, plan)  # refuse before changing anything when pages would lack

    sink = getattr(manager, "evict_sink", None)
    if sink is not None and sink.capturing:  # the recall tier keeps what is evicted (engine/recall.py)
        for a, b in chunks(every_row[changed], budget):
            sub = rows[changed[a:b]]
            k = _clipped(keep[to_device(changed[a:b], keep.device)], sub)
            sink.capture(sub.slots, sub.layers, sub.heads, ~k & _inside(k, sub), RowPages(manager, sub).table)
    free_before = pool.num_free
    for idx in plan:
        _move(manager, keep, idx, rows)
    removed = (old - rows.new)[changed]
    return CompactionResult(pages_freed=pool.num_free - free_before, tokens_removed=int(removed.sum()))


def _inside(keep: torch.Tensor, rows: Rows) -> torch.Tensor:
    """``[n, T]``: the positions each row holds."""
    t = torch.arange(keep.shape[1], device=keep.device)
    return t[None, :] < to_device(rows.old, keep.device)[:, None]


def _clipped(keep: torch.Tensor, rows: Rows) -> torch.Tensor:
    """The rows' keep mask cut to each row's length, its protected tokens kept."""
    t = torch.arange(keep.shape[1], device=keep.device)
    k = keep & (t[None, :] < to_device(rows.old, keep.device)[:, None])
    if rows.protect is not None:
        k |= t[None, :] < to_device(rows.protect, keep.device)[:, None]
    return k


def _move(manager, keep: torch.Tensor, idx: torch.Tensor, rows: Rows) -> None:
    """Carry out the rows ``idx`` (indices into ``rows`` and ``keep``): their kept tokens at or after
    the leading run move to index ``j`` (their rank among the row's kept tokens) in one gather and
    one scatter, their tails go back to the pool, and the pages they write that another owner still
    reads are copied first."""
    pool, P, dev = manager.pool, manager.page_size, manager.device
    if idx.numel() == 0:
        return
    rows = rows[idx]
    k = _clipped(keep[to_device(idx, keep.device)], rows)
    pages = RowPages(manager, rows)
    table, tail = pages.table, pages.tail

    # device: sources of the tokens that move and their ranks
    t = torch.arange(k.shape[1], device=k.device)
    movers = k & (t[None, :] >= to_device(rows.lead, k.device)[:, None])
    n_move = int((rows.new - rows.lead).sum())
    r, tt = _nonzero(movers, n_move)
    rank = (k.long().cumsum(1) - 1)[r, tt]
    del k, movers
    table_d = to_device(table, dev)
    src = table_d[r, tt // P] * P + tt % P
    moved_kv = pool.format.take_tokens(src)  # queued before any page below is reused
    moved_pos = pool.pos.view(-1)[src]

    # host: free the tails, then copy-on-write the written pages another owner still reads
    new_table = table.clone()
    pool.decref(table[tail])
    new_table[tail] = -1
    shared = pages.written_shared & (pool.refcount[table.clamp(min=0)] > 1)  # a freed tail may have been its twin
    if bool(shared.any()):
        old_pages = table[shared]
        fresh = pool.alloc(old_pages.numel())
        pool.copy_pages(to_device(old_pages, dev), to_device(fresh, dev))
        new_table[shared] = fresh
        pool.decref(old_pages)
    if n_move:
        dst = to_device(new_table, dev)[r, rank // P] * P + rank % P
        pool.format.put_tokens(dst, moved_kv)
        pool.pos.view(-1)[dst] = moved_pos

    manager.set_rows(rows.slots, rows.layers, rows.heads, new_table.to(torch.int32), rows.new.to(torch.int32))


def _nonzero(mask: torch.Tensor, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, column) of the ``size`` True entries of ``mask``, row-major, without a second host sync
    where torch can size the result from ``size``."""
    if size == 0:
        e = torch.empty(0, dtype=torch.int64, device=mask.device)
        return e, e
    try:
        idx = torch.nonzero_static(mask, size=size)
    except (AttributeError, NotImplementedError, RuntimeError):
        idx = torch.nonzero(mask)
    return idx[:, 0], idx[:, 1]


class CompactionOps:
    """The CacheManager's keep decisions (a mixin over PageTables and HostTierOps): index lists or
    masks of any rows, carried out in one ``compact``."""

    def evict(self, seq_id: Hashable, layer: int, keep: Keep) -> int:
        """Keep only ``keep[h]`` (physical indices) in each head of one layer; free the rest."""
        return self.compact([(seq_id, layer, keep)]).pages_freed

    def evict_many(self, layer: int, items: Sequence[tuple[Hashable, Keep]]) -> int:
        """Evict in one layer of several sequences at once; returns the pages freed (net)."""
        return self.compact([(seq_id, layer, keep) for seq_id, keep in items]).pages_freed

    def compact(
        self, items: Sequence[tuple[Hashable, int, Keep]], protected: Mapping[Hashable, int] | None = None
    ) -> CompactionResult:
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

    def compact_mask(
        self,
        slots: torch.Tensor,
        layers: torch.Tensor,
        heads: torch.Tensor,
        keep: torch.Tensor,
        protect: torch.Tensor | None = None,
    ) -> CompactionResult:
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
        return self.compact_mask(
            slots, layers, heads, keep.reshape(L * H, -1), torch.full((L * H,), protect) if protect else None
        )
