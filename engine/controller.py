"""SparseController: calls each sequence's method at every lifecycle point and carries out its decisions.

Sequences in one batch may use different methods (a session chooses its own). The controller
groups a batch by method instance, gives each method only its rows, merges the views they return
and turns keep-decisions into ``CacheManager.evict_many`` calls. Decisions of decode steps, turn
ends and scoring passes are carried out at once; those of prefill chunks once the forward pass is
queued (a later layer never reads an earlier layer's cache), so the pass never waits for the host
between layers and all their indices reach the host in one copy; freed pages are back in the pool
before the next step is scheduled. A hook a method does not override is never called and costs no
work; the engine never asks which method it is.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Hashable, Mapping, Sequence

import torch

from engine.cache.manager import CacheManager
from engine.lifecycle import (
    ChunkInfo,
    DecodeBatch,
    KeepMask,
    ModelShape,
    PrefillChunk,
    ScoringPass,
    Selection,
    SeqInfo,
    Span,
    SparseMethod,
)
from engine.method_spec import MethodError, MethodSpec
from engine.methods import create_method
from engine.recall import STATE_PREFIX as RECALL_STATE
from engine.recall import RecallResult, RecallTier

SeqId = Hashable


def check_layout(method: SparseMethod, fmt) -> None:
    """A method runs only on a pool whose page format is the layout it declares."""
    want = method.kv_layout()
    if (want.format, tuple(sorted(want.args))) != fmt.key:
        raise MethodError(
            f"method {method.name!r} stores KV as {want.describe()} pages, but this engine's page pool "
            f"holds {fmt.describe()} pages (the pool's format follows the engine's configured method); "
            f"start an engine with this method to use it"
        )


def _overrides(method: SparseMethod, hook: str) -> bool:
    return getattr(type(method), hook) is not getattr(SparseMethod, hook)


class SparseController:
    def __init__(self, shape: ModelShape, manager: CacheManager, recall_host_bytes: int = 8 << 30):
        self.shape = shape
        self.manager = manager
        self.recall = RecallTier(shape, manager, recall_host_bytes)
        """The cold tier of ``<method>+recall`` sequences (engine/recall.py)."""
        self._instances: dict[tuple, SparseMethod] = {}
        self._method_of: dict[SeqId, SparseMethod] = {}
        self._protected: dict[SeqId, int] = {}
        self._pending: list[tuple[int, SeqId, Any]] = []
        """(layer, seq_id, keep) decided by prefill chunks of the forward pass in flight."""
        self.evicted_pages = 0
        """Pages returned to the pool by method decisions (a counter for tests and metrics)."""
        self.evicted_tokens = 0

    # --- membership ----------------------------------------------------------------------------
    def method_for(self, spec: MethodSpec) -> SparseMethod:
        """The (shared) instance of a spec's method; raises MethodError for a bad spec."""
        key = spec.key()
        if key not in self._instances:
            method = create_method(spec, self.shape)
            check_layout(method, self.manager.pool.format)
            self._instances[key] = method
        return self._instances[key]

    def admit(self, seq: SeqInfo, spec: MethodSpec) -> SparseMethod:
        method = self.method_for(spec)
        self._method_of[seq.seq_id] = method
        if seq.protected_len:
            self._protected[seq.seq_id] = seq.protected_len
        if (settings := method.recall_settings()) is not None:
            self.recall.admit(seq.seq_id, settings)
        method.on_admit(seq)
        return method

    def method_of(self, seq_id: SeqId) -> SparseMethod:
        return self._method_of[seq_id]

    def release(self, seq_id: SeqId) -> None:
        method = self._method_of.pop(seq_id, None)
        self._protected.pop(seq_id, None)
        self.recall.release(seq_id)
        if method is not None:
            method.release(seq_id)

    def fork(self, seq_id: SeqId, child_id: SeqId) -> None:
        method = self._method_of[seq_id]
        self._method_of[child_id] = method
        if seq_id in self._protected:
            self._protected[child_id] = self._protected[seq_id]
        method.fork_state(seq_id, child_id)
        self.recall.fork(seq_id, child_id)

    def state_dict(self, seq_id: SeqId) -> dict[str, Any]:
        """The method's state and the sequence's cold tier (host tensors, ``recall.*``)."""
        return {**self._method_of[seq_id].state_dict(seq_id), **self.recall.state(seq_id)}

    def load_state_dict(self, seq_id: SeqId, state: Mapping[str, Any]) -> None:
        """Tensors of the method's state go to the cache's device; the cold tier stays on the host."""
        cold = {k: v for k, v in state.items() if k.startswith(RECALL_STATE)}
        own = {
            k: v.to(self.manager.device) if isinstance(v, torch.Tensor) else v
            for k, v in state.items()
            if not k.startswith(RECALL_STATE)
        }
        if own:
            self._method_of[seq_id].load_state_dict(seq_id, own)
        self.recall.load(seq_id, cold)

    # --- recall (the cold tier of <method>+recall sequences) --------------------------------------
    def recall_settings(self, seq_id: SeqId):
        """The recall settings of ``seq_id``'s method (None: its evictions are not recallable)."""
        method = self._method_of.get(seq_id)
        return None if method is None else method.recall_settings()

    def recall_now(self, seq_id: SeqId, num_tokens: int, queries: torch.Tensor, at_input: bool) -> RecallResult:
        """Recall what ``queries`` ``[L, n, Hq, D]`` attend to into ``seq_id``'s heads, within its
        method's budget for ``num_tokens`` logical tokens (not its slack: a recall fills a head up to
        the budget, or swaps within what it holds when it holds more). ``at_input``: the queries are
        a turn's input (with ``recall_scope="earlier"``, what this turn evicted is not a candidate)."""
        method = self._method_of[seq_id]
        cap = min(num_tokens, method.device_budget(num_tokens) or 0)
        return self.recall.recall(seq_id, queries, cap, self._protected.get(seq_id, 0), at_input)

    # --- prefill ----------------------------------------------------------------------------------
    def prefill_probs_window(self, chunk: ChunkInfo) -> int:
        method = self._method_of[chunk.seq_id]
        return method.prefill_probs_window(chunk) if _overrides(method, "prefill_probs_window") else 0

    def prefill_view(self, layer: int, chunk: ChunkInfo) -> Selection | None:
        if self.manager.num_host_pages(chunk.seq_id, layer):  # a prefill reads every page: bring them back
            self.manager.recall(chunk.seq_id, layer)
        method = self._method_of[chunk.seq_id]
        return method.prefill_view(layer, chunk) if _overrides(method, "prefill_view") else None

    def wants_after_prefill(self, seq_id: SeqId) -> bool:
        return _overrides(self._method_of[seq_id], "after_prefill_chunk")

    def after_prefill_chunk(self, layer: int, chunk: PrefillChunk) -> None:
        """The method's keep decision is applied once the whole forward pass is queued
        (``apply_pending_evictions``): a later layer never reads this layer's cache, and the pass
        then never waits for the host between layers (keep indices may still be on the device)."""
        keep = self._method_of[chunk.seq_id].after_prefill_chunk(layer, chunk)
        if keep is not None:
            self._pending.append((chunk.seq_id, layer, keep))

    def apply_pending_evictions(self) -> None:
        """Carry out the keep decisions the pass just run made (its prefill chunks' and decode
        steps'), every layer of every sequence in one compaction."""
        pending, self._pending = self._pending, []
        self._compact(pending)
        for method in self._deferring_methods():
            decided = method.after_prefill_pass()
            if decided is not None and decided.seq_ids:
                self._compact_mask(decided)

    def drop_pending_evictions(self) -> None:
        """The pass failed: its decisions are dropped (the cache keeps those tokens)."""
        self._pending = []
        for method in self._deferring_methods():
            method.after_prefill_pass()

    def _deferring_methods(self) -> list[SparseMethod]:
        return [m for m in self._instances.values() if _overrides(m, "after_prefill_pass")]

    # --- scoring pass (after a turn's prefill) -----------------------------------------------------
    def wants_scoring_pass(self, seq_id: SeqId) -> bool:
        return _overrides(self._method_of[seq_id], "scoring_pass")

    def scoring_pass(self, seq_id: SeqId, num_tokens: int, token_ids, tokenizer) -> ScoringPass | None:
        return self._method_of[seq_id].scoring_pass(self._info(seq_id, num_tokens), token_ids, tokenizer)

    def observe_scoring(self, layer: int, chunk: PrefillChunk) -> None:
        self._method_of[chunk.seq_id].observe_scoring(layer, chunk)

    def after_scoring(self, seq_id: SeqId, num_tokens: int) -> None:
        per_layer = self._method_of[seq_id].after_scoring(self._info(seq_id, num_tokens)) or {}
        self._compact([(seq_id, layer, keep) for layer, keep in per_layer.items()])

    def protected_len(self, seq_id: SeqId) -> int:
        """Leading tokens of ``seq_id`` that compactions keep (a shared prefix)."""
        return self._protected.get(seq_id, 0)

    def _info(self, seq_id: SeqId, num_tokens: int) -> SeqInfo:
        return SeqInfo(seq_id, num_tokens, self._protected.get(seq_id, 0))

    # --- decode -----------------------------------------------------------------------------------
    def group(self, seq_ids: Sequence[SeqId]) -> list[tuple[SparseMethod, list[int]]]:
        """Rows of a batch grouped by method instance, in first-seen order."""
        rows: dict[int, list[int]] = defaultdict(list)
        methods: dict[int, SparseMethod] = {}
        for i, s in enumerate(seq_ids):
            m = self._method_of[s]
            methods[id(m)] = m
            rows[id(m)].append(i)
        return [(methods[k], rows[k]) for k in rows]

    def decode_hooks_due(self, seq_ids: Sequence[SeqId], lengths: torch.Tensor) -> bool:
        """Does any method in the batch act on this decode step (``lengths`` ``[B, L, H]``, host)?"""
        for m, rows in self.group(seq_ids):
            if m.needs_decode_probs or _overrides(m, "decode_view") or _overrides(m, "after_decode"):
                if m.decode_hooks_due([seq_ids[i] for i in rows], lengths[rows]):
                    return True
        return False

    def graph_decode_method(self, seq_ids: Sequence[SeqId], lengths: torch.Tensor) -> tuple[bool, SparseMethod | None]:
        """Can this decode step run as a CUDA graph, and with which method's selection inside it?
        ``(True, None)``: no method acts this step; ``(True, m)``: every row uses ``m``, whose
        ``decode_view`` a graph can capture; ``(False, None)``: the step runs eagerly."""
        if not self.decode_hooks_due(seq_ids, lengths):
            return True, None
        groups = self.group(seq_ids)
        if len(groups) == 1:
            m = groups[0][0]
            if m.graph_decode() and not m.needs_decode_probs and not _overrides(m, "after_decode"):
                return True, m
        return False, None

    def decode_needs_probs(self, groups) -> bool:
        return any(m.needs_decode_probs for m, _ in groups)

    def decode_needs_probs_at(self, groups, layer: int) -> bool:
        return any(m.needs_decode_probs and m.needs_decode_probs_at(layer) for m, _ in groups)

    def decode_selections(self, layer: int, groups, batch: DecodeBatch) -> list[tuple[list[int], Selection]]:
        """Each method's selection for its rows of a decode step, ``[(rows, selection)]`` (methods
        that select nothing this step left out). Nothing moves: the caller carries out the
        selections' tier moves (``move_tiers``), then merges them (``merge_selections``)."""
        parts = [(rows, m.decode_view(layer, _rows(batch, rows))) for m, rows in groups if _overrides(m, "decode_view")]
        return [(rows, sel) for rows, sel in parts if sel is not None]

    def merge_selections(self, parts, batch: DecodeBatch) -> Selection | None:
        """Merge the selections of every method in the batch into batch-wide tensors."""
        if not parts:
            return None
        B, H = batch.lengths.shape
        dev = batch.q.device
        merged = Selection()
        if len(parts) == 1 and len(parts[0][0]) == B and parts[0][1].token_mask is None:
            sel = parts[0][1]  # one method for the whole batch: its selection as it is
            if sel.selected_pages is not None:
                sel.selected_pages = sel.selected_pages.to(dev, torch.int64)
            return sel
        if any(sel.selected_pages is not None for _, sel in parts):
            # rows whose method selects no pages read them all: 0 .. max_pages-1
            width = self.manager.max_pages
            out = torch.arange(width, device=dev).repeat(B, H, 1)
            for rows, sel in parts:
                if sel.selected_pages is not None:
                    idx = torch.tensor(rows, device=dev)
                    chosen = sel.selected_pages.to(dev, torch.int64)
                    out[idx] = -1
                    out[idx, :, : chosen.shape[-1]] = chosen
            merged.selected_pages = out
        if any(sel.token_mask is not None for _, sel in parts):
            T = max(sel.token_mask.shape[-1] for _, sel in parts if sel.token_mask is not None)
            mask = torch.ones(B, H, T, dtype=torch.bool, device=dev)
            for rows, sel in parts:
                if sel.token_mask is not None:
                    tm = sel.token_mask.to(dev)
                    mask[torch.tensor(rows, device=dev), :, : tm.shape[-1]] = tm
                    if tm.shape[-1] < T:
                        mask[torch.tensor(rows, device=dev), :, tm.shape[-1] :] = False
            merged.token_mask = mask
        return merged

    def move_tiers(self, layer: int, parts, batch: DecodeBatch) -> bool:
        """Carry out the offload decisions of ``decode_selections``: pages in ``to_host`` leave the
        device, then selected pages that sit on the host are fetched back, so GPU pages in use stay
        bounded. True when page tables may have changed (the caller builds its view again)."""
        moved = self.manager.has_host_tier or any(sel.to_host is not None for _, sel in parts)
        for rows, sel in parts:
            if sel.to_host is None and not self.manager.has_host_tier:
                continue
            for j, r in enumerate(rows):
                seq_id = batch.seq_ids[r]
                if sel.to_host is not None:
                    self.manager.offload_pages(seq_id, layer, sel.to_host[j].cpu())
                if sel.selected_pages is not None and self.manager.num_host_pages(seq_id, layer):
                    self.manager.fetch_pages(seq_id, layer, sel.selected_pages[j].cpu())
        return moved

    def after_decode(self, layer: int, groups, batch: DecodeBatch) -> None:
        """Decisions of decode steps are applied with the pass's others (``apply_pending_evictions``)."""
        for m, rows in groups:
            if not _overrides(m, "after_decode"):
                continue
            decisions = m.after_decode(layer, _rows(batch, rows))
            if decisions:
                self._pending.extend((seq_id, layer, keep) for seq_id, keep in decisions.items())

    def after_decode_step(self, seq_ids: Sequence[SeqId], num_tokens: Sequence[int]) -> None:
        """After a decode step (a graph replay or eager): the evictions methods decide from the heads'
        lengths alone, one compaction per method that decided any."""
        for m, rows in self.group(seq_ids):
            if not _overrides(m, "after_decode_step"):
                continue
            slots = torch.tensor([self.manager.slot(seq_ids[i]) for i in rows])
            infos = [self._info(seq_ids[i], num_tokens[i]) for i in rows]
            decided = m.after_decode_step(infos, self.manager.lengths[slots])
            if decided is not None and decided.seq_ids:
                self._compact_mask(decided)

    def _compact_mask(self, decided: KeepMask) -> None:
        B, L, H, T = decided.mask.shape
        slots = torch.tensor([self.manager.slot(s) for s in decided.seq_ids]).repeat_interleave(L * H)
        layers = torch.arange(L).repeat_interleave(H).repeat(B)
        heads = torch.arange(H).repeat(B * L)
        prot = torch.tensor([self._protected.get(s, 0) for s in decided.seq_ids]).repeat_interleave(L * H)
        result = self.manager.compact_mask(
            slots, layers, heads, decided.mask.reshape(B * L * H, T), prot if bool(prot.any()) else None
        )
        self.evicted_pages += result.pages_freed
        self.evicted_tokens += result.tokens_removed

    # --- turn end ---------------------------------------------------------------------------------
    def on_turn_end(self, seq: SeqInfo, spans: Sequence[Span]) -> None:
        method = self._method_of[seq.seq_id]
        self.recall.next_turn(seq.seq_id)
        if _overrides(method, "on_turn_end"):
            per_layer = method.on_turn_end(seq, spans) or {}
            self._compact([(seq.seq_id, layer, keep) for layer, keep in per_layer.items()])
        self.recall.turn_done(seq.seq_id)

    def _compact(self, items) -> None:
        if not items:
            return
        result = self.manager.compact(items, self._protected)
        self.evicted_pages += result.pages_freed
        self.evicted_tokens += result.tokens_removed


def _rows(batch: DecodeBatch, rows: list[int]) -> DecodeBatch:
    """The sub-batch of ``rows`` (the batch itself when it is all of it)."""
    if len(rows) == len(batch.seq_ids):
        return batch
    idx = torch.tensor(rows)
    dev_idx = idx.to(batch.q.device)
    return DecodeBatch(
        layer=batch.layer,
        seq_ids=[batch.seq_ids[i] for i in rows],
        num_tokens=[batch.num_tokens[i] for i in rows],
        q=batch.q[dev_idx],
        lengths=batch.lengths[idx],
        cache=batch.cache,
        probs=None if batch.probs is None else batch.probs[dev_idx],
        k=None if batch.k is None else batch.k[dev_idx],
        tables=None if batch.tables is None else batch.tables[dev_idx],
        device_lengths=None if batch.device_lengths is None else batch.device_lengths[dev_idx],
    )
