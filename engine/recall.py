"""RecallTier: what ``<method>+recall`` sessions evict stays recallable, and comes back when asked for.

Drop from the device, never from the session. For each sequence whose method is a recall variant
(engine/methods/recall_variant.py) the tier

* **captures**: every compaction of such a sequence (a method's eviction, a prune) hands it the
  evicted tokens before their pages are reused (``capture``, called from engine/cache/compaction.py
  through ``CacheManager.evict_sink``); they go to the sequence's ColdStore on the host;
* **recalls** (``recall``): queries ``[L, n, Hq, D]`` (the turn's last input tokens, or the latest
  decode steps) score every cold block by its key bounds; each kv-head's ``recall_pages`` best
  blocks are fetched and ranked together with the head's hot tokens by their exact logits
  ``max q . k`` over the queries; the best fill the head up to its cap (the method's budget, or
  what it holds now if more) and the rest go (back) to the cold tier. Protected prefix tokens
  and the head's latest ``recall_window`` tokens always stay. Rows stay sorted by position;
* **bounds host memory**: all cold stores together hold at most ``recall_host_gb``. At the bound
  a store first drops its dead blocks; if that is not enough, the newly evicted tokens are
  destroyed as they would be without recall, and counted (``dropped_tokens``).

The tier's per-sequence state travels in the method state of snapshots (``state`` / ``load``), so
a session resumed on another engine has its cold tier, and forks copy it.

Copies between the device and the host do not hold up the engine thread (engine/cache/cold_copy.py):
a capture's copy to the host runs on a side stream and lands in the store when it has run (``poll``,
after every pass) or when the store must read it; a recall starts copying its candidate blocks to
the device before it gathers the hot tokens, and waits for them only to rank them. The traffic is
counted (``RecallTraffic``: bytes each way, cold pages fetched) per sequence and turn, and in total.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Hashable

import torch

from engine.cache.cold_copy import ColdCopier
from engine.cache.cold_store import ColdStore
from engine.cache.errors import OutOfPages
from engine.cache.rewrite import rewrite_rows
from engine.cache.transfer import to_device
from engine.lifecycle import ModelShape

SeqId = Hashable
STATE_PREFIX = "recall."


@dataclass
class RecallResult:
    """One recall of one sequence."""

    candidates: int = 0
    """Cold tokens fetched and ranked (summed over layers and kv-heads)."""
    recalled: int = 0
    """Of those, tokens now on the device."""
    displaced: int = 0
    """Hot tokens moved to the cold tier in their place."""


@dataclass
class RecallTraffic:
    """What the cold tier copied (one sequence's turn, or the tier's total)."""

    d2h_bytes: int = 0
    """Evicted (and displaced) K/V, positions and fp8 scales copied to the host."""
    h2d_bytes: int = 0
    """Candidate cold blocks copied to the device."""
    pages_fetched: int = 0
    """Cold blocks copied to the device (a block is a page of one layer's kv-head)."""
    recalled_tokens: int = 0
    """Of the fetched tokens, those kept on the device (summed over layers and kv-heads)."""
    recalls: int = 0

    def add(self, other: "RecallTraffic") -> None:
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))


class RecallTier:
    def __init__(self, shape: ModelShape, manager, host_limit_bytes: int):
        self.shape = shape
        self.manager = manager
        self.host_limit = host_limit_bytes
        self.settings: dict[SeqId, object] = {}
        self.stores: dict[SeqId, ColdStore] = {}
        self.copier = ColdCopier.for_device(manager.device)
        self.traffic = RecallTraffic()
        """Since the engine started."""
        self.turn_traffic: dict[SeqId, RecallTraffic] = {}
        """Each sequence's turn in progress (from the end of its previous turn on)."""
        self.last_turn_traffic: dict[SeqId, RecallTraffic] = {}
        """Each sequence's last finished turn."""
        self.captured_tokens = 0
        """Evicted tokens stored by captures."""
        self.returned_tokens = 0
        """Tokens a recall sent (back) to the host: displaced hot ones, candidates not kept."""
        self.dropped_tokens = 0
        """Evicted tokens destroyed because the tier was at ``host_limit``."""
        manager.evict_sink = self

    # --- membership ------------------------------------------------------------------------------
    def admit(self, seq_id: SeqId, settings) -> None:
        self.settings[seq_id] = settings

    def enabled(self, seq_id: SeqId) -> bool:
        return seq_id in self.settings

    def release(self, seq_id: SeqId) -> None:
        self.settings.pop(seq_id, None)
        self.turn_traffic.pop(seq_id, None)
        self.last_turn_traffic.pop(seq_id, None)
        store = self.stores.pop(seq_id, None)
        if store is not None:
            store.discard()

    def fork(self, parent: SeqId, child: SeqId) -> None:
        if parent in self.settings:
            self.settings[child] = self.settings[parent]
        if parent in self.stores:
            self.stores[child] = self.stores[parent].clone()

    @property
    def capturing(self) -> bool:
        """Does any sequence keep what it evicts (else compactions skip ``capture`` entirely)?"""
        return bool(self.settings)

    @property
    def host_bytes(self) -> int:
        return sum(s.nbytes for s in self.stores.values())

    @property
    def recalls(self) -> int:
        return self.traffic.recalls

    @property
    def recalled_tokens(self) -> int:
        return self.traffic.recalled_tokens

    @property
    def staging_buffers(self) -> int:
        """Pinned buffers held by copies to the host still in flight (every store's)."""
        return sum(s.staging_buffers for s in self.stores.values())

    def poll(self) -> None:
        """Write the copies to the host that have run into their stores (never waits)."""
        for store in self.stores.values():
            if store.pending:
                store.poll()

    def _count(self, seq_id: SeqId, traffic: RecallTraffic) -> None:
        self.traffic.add(traffic)
        self.turn_traffic.setdefault(seq_id, RecallTraffic()).add(traffic)

    def cold_tokens(self, seq_id: SeqId) -> int:
        store = self.stores.get(seq_id)
        return 0 if store is None else store.live_tokens()

    def cold_positions(self, seq_id: SeqId) -> list[list[torch.Tensor]]:
        """Positions of each (layer, kv-head)'s recallable tokens (host), for fidelity measures."""
        L, H = self.shape.num_layers, self.shape.num_kv_heads
        store = self.stores.get(seq_id)
        if store is None:
            return [[torch.empty(0, dtype=torch.int32) for _ in range(H)] for _ in range(L)]
        store.flush()
        keep = store.live_slots()
        return [[store.pos[layer, h][keep[layer, h]] for h in range(H)] for layer in range(L)]

    def _store(self, seq_id: SeqId) -> ColdStore:
        if seq_id not in self.stores:
            s, pool = self.shape, self.manager.pool
            fmt = self.settings[seq_id].cold_format
            self.stores[seq_id] = ColdStore(
                s.num_layers, s.num_kv_heads, s.head_dim, s.page_size, pool.dtype, pool.device, fmt, self.copier
            )
        return self.stores[seq_id]

    # --- capture ---------------------------------------------------------------------------------
    def capture(self, slots, layers, heads, evicted: torch.Tensor, table: torch.Tensor) -> None:
        """Rows ``(slots[r], layers[r], heads[r])`` (host) are about to lose the tokens ``evicted``
        ``[R, T]`` (device bool) marks; ``table`` ``[R, NP]`` (host) holds their pages."""
        if not self.settings:
            return
        m = self.manager
        enabled = {m.slot(s): s for s in self.settings if m.has(s)}
        rows = [i for i, s in enumerate(slots.tolist()) if s in enabled]
        if not rows:
            return
        idx = torch.tensor(rows)
        dev, P, H = m.device, m.page_size, m.num_kv_heads
        r, tt = evicted[to_device(idx, evicted.device)].nonzero(as_tuple=True)
        if r.numel() == 0:
            return
        src = to_device(table[idx], dev)[r, tt // P] * P + tt % P
        k, v = m.pool.format.read_tokens(src)
        pos = m.pool.pos.view(-1)[src]
        r_host, tt_host = r.cpu(), tt.cpu()
        row_slot = slots[idx][r_host]
        row_id = layers[idx][r_host] * H + heads[idx][r_host]
        for slot in torch.unique(row_slot).tolist():
            mine = (row_slot == slot).nonzero().flatten()
            order = mine[torch.argsort(row_id[mine] * (int(tt_host.max()) + 1) + tt_host[mine], stable=True)]
            o = to_device(order, k.device)
            n = self._append(enabled[slot], row_id[order], k[o], v[o], pos[o])
            self.captured_tokens += n

    def _append(self, seq_id: SeqId, rows: torch.Tensor, k, v, pos) -> int:
        """Tokens (``rows`` host, layer * H + head, ascending; each row's in position order) into the
        sequence's store, within the host bound; returns how many were stored (the rest dropped)."""
        store = self._store(seq_id)
        grow = store.growth_bytes(rows)
        if grow and self.host_bytes + grow > self.host_limit:
            store.compact()
            grow = store.growth_bytes(rows)
        if grow and self.host_bytes + grow > self.host_limit:
            self.dropped_tokens += rows.numel()
            return 0
        self._count(seq_id, RecallTraffic(d2h_bytes=store.append(rows, k, v, pos)))
        return rows.numel()

    # --- recall ----------------------------------------------------------------------------------
    def next_turn(self, seq_id: SeqId) -> None:
        """A turn of ``seq_id`` ended: what it evicted becomes recallable at the next turn's input."""
        if seq_id in self.stores:
            self.stores[seq_id].next_turn()

    def turn_done(self, seq_id: SeqId) -> None:
        """The turn's end (its end-of-turn compression included) is through: its traffic is final."""
        if seq_id in self.settings:
            self.last_turn_traffic[seq_id] = self.turn_traffic.pop(seq_id, RecallTraffic())

    def turn_report(self, seq_id: SeqId) -> RecallTraffic:
        """The traffic of ``seq_id``'s last finished turn (zeros before its first, or without recall)."""
        return self.last_turn_traffic.get(seq_id, RecallTraffic())

    def recall(self, seq_id: SeqId, queries: torch.Tensor, cap: int, protect: int, at_input: bool) -> RecallResult:
        """Bring back the cold tokens ``queries`` ``[L, n, Hq, D]`` attend to most; each head then
        holds at most ``max(cap, what it holds now)`` tokens. ``at_input``: the queries are a
        turn's input; with ``recall_scope="earlier"`` only what earlier turns evicted is a candidate
        then (the method's own choice for this turn stands)."""
        store = self.stores.get(seq_id)
        settings = self.settings.get(seq_id)
        if store is None or settings is None or store.live_tokens() == 0:
            return RecallResult()
        m, s = self.manager, self.shape
        L, H, D, P = s.num_layers, s.num_kv_heads, s.head_dim, s.page_size
        n = queries.shape[1]
        q = queries.reshape(L, n, H, -1, D).permute(0, 2, 1, 3, 4).reshape(L, H, -1, D).float()
        earlier_only = at_input and settings.recall_scope == "earlier"
        bounds = store.block_scores(q, store.turn if earlier_only else None)  # [L, H, NB]
        slot = m.slot(seq_id)
        length = m.lengths[slot].long()  # [L, H]
        pages = settings.recall_pages or max(1, -(-max(cap, 1) // P))
        top = bounds.topk(min(pages, bounds.shape[-1]), dim=-1)
        blocks = torch.where(torch.isfinite(top.values), top.indices, -1).cpu()
        if not bool((blocks >= 0).any()):
            return RecallResult()
        fetch = store.fetch(blocks)  # copied to the device while the hot tokens are gathered
        hot_k, hot_v, hot_pos = self._hot(seq_id, int(length.max()))
        cand = fetch.wait()
        self._count(seq_id, RecallTraffic(h2d_bytes=fetch.nbytes, pages_fetched=int((blocks >= 0).sum())))
        k = torch.cat([hot_k, cand.k.to(hot_k.dtype)], 2)  # [L, H, T + C, D]
        v = torch.cat([hot_v, cand.v.to(hot_v.dtype)], 2)
        pos = torch.cat([hot_pos, cand.pos.to(hot_pos.device, hot_pos.dtype)], 2)
        T = hot_pos.shape[2]
        valid = pos >= 0
        logit = _pooled(_score(q, k, valid, settings.recall_score), pos, valid, settings.recall_pool)  # [L, H, T + C]
        idx = torch.arange(k.shape[2], device=k.device)
        len_d = to_device(length, k.device)
        keep_recent = min(settings.recall_window, max(cap, 2) // 2)  # at most half the budget is pinned
        recent = (idx < T) & (idx >= (len_d - keep_recent)[..., None])
        # with a reserve the method's own tokens are never displaced: the recall only fills the room
        # the method leaves (it keeps ``1 - recall_reserve`` of the budget)
        forced = valid & ((pos < protect) | recent | ((idx < T) & (settings.recall_reserve > 0)))
        key = torch.where(forced, float("inf"), torch.where(valid, logit, float("-inf")))
        limit = torch.maximum(len_d, torch.full_like(len_d, cap))  # [L, H]
        order = key.argsort(dim=-1, descending=True, stable=True)
        ranked = torch.zeros_like(valid)
        ranked.scatter_(-1, order, idx.expand_as(order) < limit[..., None])
        kept = ranked & valid
        out = valid & ~kept
        result = RecallResult(
            candidates=int((pos[..., T:] >= 0).sum()),
            recalled=int(kept[..., T:].sum()),
            displaced=int(out[..., :T].sum()),
        )
        if result.recalled == 0:
            self._back(seq_id, k, v, pos, valid & (idx >= T))
            return RecallResult(candidates=result.candidates)
        # the new rows: kept tokens in position order
        sort_key = torch.where(kept, pos.long(), torch.iinfo(torch.int64).max)
        new_order = sort_key.argsort(dim=-1, stable=True)
        new_len = kept.sum(-1)
        gather = new_order[..., None].expand(-1, -1, -1, D)
        new_k, new_v = k.gather(2, gather), v.gather(2, gather)
        new_pos = torch.where(idx < new_len[..., None], pos.gather(2, new_order), -1)
        same = (new_pos[..., :T] == hot_pos) & (hot_pos >= 0)
        lead = same.int().cumprod(-1).sum(-1)
        R = L * H
        try:
            rewrite_rows(
                m,
                torch.full((R,), slot),
                torch.arange(L).repeat_interleave(H),
                torch.arange(H).repeat(L),
                new_k.reshape(R, -1, D),
                new_v.reshape(R, -1, D),
                new_pos.reshape(R, -1),
                new_len.reshape(R).cpu(),
                (lead // P).reshape(R).cpu(),
            )
        except OutOfPages:  # the pool cannot hold the rewrite now: everything stays as it was
            self._back(seq_id, k, v, pos, valid & (idx >= T))
            return RecallResult(candidates=result.candidates)
        self._back(seq_id, k, v, pos, out)
        self._count(seq_id, RecallTraffic(recalled_tokens=result.recalled, recalls=1))
        return result

    def _hot(self, seq_id: SeqId, T: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Every layer of the sequence padded to ``T`` tokens: k, v ``[L, H, T, D]``, pos ``[L, H, T]``."""
        ks, vs, ps = [], [], []
        for layer in range(self.shape.num_layers):
            k, v, pos, _ = self.manager.gather(seq_id, layer)
            pad = T - k.shape[1]
            ks.append(torch.nn.functional.pad(k, (0, 0, 0, pad)))
            vs.append(torch.nn.functional.pad(v, (0, 0, 0, pad)))
            ps.append(torch.nn.functional.pad(pos, (0, pad), value=-1))
        return torch.stack(ks), torch.stack(vs), torch.stack(ps)

    def _back(self, seq_id: SeqId, k, v, pos, mask: torch.Tensor) -> None:
        """Tokens ``mask`` ``[L, H, T]`` of ``k``/``v``/``pos`` go to the cold tier, in position order."""
        L, H, T = mask.shape
        key = torch.where(mask, pos.long(), torch.iinfo(torch.int64).max)
        order = key.argsort(dim=-1, stable=True)
        count = mask.sum(-1)  # [L, H]
        take = torch.arange(T, device=mask.device) < count[..., None]
        li, hi, j = take.nonzero(as_tuple=True)
        src = order[li, hi, j]
        rows = (li * H + hi).cpu()
        if rows.numel() == 0:
            return
        self.returned_tokens += self._append(seq_id, rows, k[li, hi, src], v[li, hi, src], pos[li, hi, src])

    # --- snapshot --------------------------------------------------------------------------------
    def state(self, seq_id: SeqId) -> dict[str, torch.Tensor]:
        store = self.stores.get(seq_id)
        if store is None:
            return {}
        return {STATE_PREFIX + k: v for k, v in store.state().items()}

    def load(self, seq_id: SeqId, state: dict) -> None:
        mine = {k[len(STATE_PREFIX) :]: v for k, v in state.items() if k.startswith(STATE_PREFIX)}
        if not mine or seq_id not in self.settings:
            return
        store = self._store(seq_id)
        store.load(mine)


def _score(q: torch.Tensor, k: torch.Tensor, valid: torch.Tensor, rule: str) -> torch.Tensor:
    """Each token's score ``[L, H, N]`` under the queries ``q`` ``[L, H, Q, D]`` (a head's group, every
    window position): ``logit``, the best exact logit ``max q . k``; ``mass``, the attention weight the
    queries give it, summed over them (a softmax over the head's valid tokens, as SnapKV weighs a
    window: a query whose attention is diffuse lends little)."""
    logits = q @ k.float().transpose(-1, -2)  # [L, H, Q, N]
    if rule == "logit":
        return logits.amax(-2)
    logits = (logits * q.shape[-1] ** -0.5).masked_fill(~valid[:, :, None, :], float("-inf"))
    return logits.softmax(-1).nan_to_num(0.0).sum(-2)


def _pooled(logit: torch.Tensor, pos: torch.Tensor, valid: torch.Tensor, width: int) -> torch.Tensor:
    """``logit`` ``[L, H, N]`` max-pooled over ``width`` neighbours in position order (the held
    and candidate tokens of a head are interleaved by position first; invalid slots sort last and
    never lend their score)."""
    if width <= 1:
        return logit
    L, H, N = logit.shape
    order = torch.where(valid, pos.long(), torch.iinfo(torch.int64).max).argsort(dim=-1, stable=True)
    ranked = torch.where(valid, logit, float("-inf")).gather(-1, order)
    pooled = torch.nn.functional.max_pool1d(ranked.reshape(L * H, 1, N), width, stride=1, padding=width // 2)
    return torch.empty_like(logit).scatter_(-1, order, pooled.reshape(L, H, N))
