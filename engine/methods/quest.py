"""quest: query-aware page selection from per-page key bounds; nothing is evicted.

Paper: Tang et al., "Quest: Query-Aware Sparsity for Efficient Long-Context LLM Inference" (ICML 2024);
reference code mit-han-lab/Quest ``evaluation/quest_attention.py``.
Rule: every page (the cache's page, ``page_size`` tokens of one kv-head) keeps the element-wise
minimum ``m`` and maximum ``M`` of its keys, updated as the page fills. At each decode step a page's
score for query ``q`` is the upper bound of ``q . k`` over the page,
``sum_d max(q_d * M_d, q_d * m_d)``; each kv-head attends only its ``budget / page_size``
best-scoring pages (with GQA a page's score is the largest over the head's query group), always
including the first ``n_sink_pages`` and the last ``n_recent_pages`` (the page being written).
The first ``dense_layers`` layers attend densely, as in the paper. All KV stays in the cache: only
what attention reads changes, so the selection adapts to every new query.

Implementation: the bounds live beside the pool, by physical page id (``PageBounds``, whose
docstring says how they stay right across forks, snapshots and compaction); a decode step scores
every page of every row of the batch at once (on the GPU one Triton kernel reads the bounds through
the page tables, ``quest_triton``; elsewhere a gather and two batched matrix products) and picks
each head's pages with one top-k, on the device, without host syncs.
With a budget in tokens (not a ratio: the number of pages then depends on each row's length) that
step runs inside the decode CUDA graph (``graph_decode_view``); the host only checks, before each
replay, that no sequence's page layout changed (``prepare_graph_decode``).

Parameters:
    budget / budget_ratio   tokens each head attends per decode step (rounded up to pages); required
    dense_layers = 2        leading layers that stay dense (the paper skips the first two)
    n_sink_pages = 1        leading pages always attended
    n_recent_pages = 1      trailing pages always attended (the current page included)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.lifecycle import DecodeBatch, PrefillChunk, Selection, SparseMethod
from engine.method_spec import MethodError
from engine.methods import quest_triton
from engine.methods.page_bounds import PageBounds
from engine.methods.page_selection import select_pages
from engine.methods.registry import register


@dataclass
class QuestParams:
    dense_layers: int = 2
    n_sink_pages: int = 1
    n_recent_pages: int = 1


def page_scores(q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor) -> torch.Tensor:
    """Quest's bound for queries ``q`` ``[..., Hq, D]`` against page bounds ``[..., H, NP, D]``: the
    largest ``sum_d max(q_d M_d, q_d m_d)`` over each kv-head's query group, ``[..., H, NP]``. The
    sum splits by the sign of ``q_d``: ``q+ . M + q- . m``, two (batched) matrix products."""
    H = kmin.shape[-3]
    qg = q.float().unflatten(-2, (H, -1))  # [..., H, G, D]
    s = qg.clamp(min=0) @ kmax.float().transpose(-1, -2) + qg.clamp(max=0) @ kmin.float().transpose(-1, -2)
    return s.amax(-2)


@register
class Quest(SparseMethod):
    name = "quest"
    Params = QuestParams
    needs_budget = True

    def __init__(self, spec, shape):
        super().__init__(spec, shape)
        p = self.params
        if p.dense_layers < 0 or p.n_sink_pages < 0 or p.n_recent_pages < 1:
            raise MethodError("quest: dense_layers and n_sink_pages must be >= 0, n_recent_pages >= 1")
        self._bounds: PageBounds | None = None

    def pages_for(self, num_tokens: int) -> int:
        p = self.params
        P = self.shape.page_size
        return max(-(-self.budget_for(num_tokens) // P), p.n_sink_pages + p.n_recent_pages)

    def bounds(self, cache) -> PageBounds:
        if self._bounds is None:
            self._bounds = PageBounds.of(cache.pool)
        return self._bounds

    def after_prefill_chunk(self, layer: int, chunk: PrefillChunk):
        if layer >= self.params.dense_layers:
            first = int(chunk.lengths.min()) - chunk.length  # the chunk's first token (nothing is evicted)
            self.bounds(chunk.cache).refresh(chunk.cache, chunk.seq_id, layer, max(first, 0) // self.shape.page_size)
        return None

    def decode_view(self, layer: int, batch: DecodeBatch) -> Selection | None:
        if layer < self.params.dense_layers:
            return None
        cache = batch.cache
        self.bounds(cache).ensure(cache, batch.seq_ids, layer)
        tables, lengths = batch.tables, batch.device_lengths
        if tables is None:  # a batch built by hand (tests): the same tables from the cache
            tables, lengths = _tables(cache, batch.seq_ids, layer)
        ks = [self.pages_for(n) for n in batch.num_tokens]
        k = ks[0] if len(set(ks)) == 1 else torch.tensor(ks, device=tables.device)
        return Selection(selected_pages=self._select(cache, batch.q, tables, lengths, k))

    def _select(self, cache, q: torch.Tensor, tables: torch.Tensor, lengths: torch.Tensor, k) -> torch.Tensor:
        """The pages each head reads: the current pages' bounds refreshed, every page scored, top-k."""
        p = self.params
        bounds = self.bounds(cache)
        bounds.refresh_current(tables, lengths)
        if quest_triton.fused(q):  # one kernel reads the bounds through the tables (GPU)
            scores = quest_triton.page_scores_fused(q, bounds.lo, bounds.hi, tables)
        else:
            scores = page_scores(q, *bounds.gather(tables))
        return select_pages(scores, lengths, self.shape.page_size, k, p.n_sink_pages, p.n_recent_pages)

    # --- inside the decode CUDA graph ----------------------------------------------------------
    def graph_decode(self) -> bool:
        return self.spec.budget is not None  # a fixed number of pages per head: static shapes

    def prepare_graph_decode(self, cache, seq_ids) -> None:
        self.bounds(cache).ensure_layers(cache, seq_ids, range(self.params.dense_layers, self.shape.num_layers))

    def graph_decode_view(
        self, layer: int, cache, q: torch.Tensor, tables: torch.Tensor, lengths: torch.Tensor
    ) -> torch.Tensor | None:
        if layer < self.params.dense_layers:
            return None
        return self._select(cache, q, tables, lengths, self.pages_for(self.spec.budget))

    def release(self, seq_id) -> None:
        if self._bounds is not None:
            self._bounds.forget(seq_id)


def _tables(cache, seq_ids, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    parts = [cache.page_table(s, layer) for s in seq_ids]
    NP = max(ids.shape[-1] for ids, _ in parts)
    tables = torch.stack([torch.nn.functional.pad(ids, (0, NP - ids.shape[-1]), value=-1) for ids, _ in parts])
    return tables, torch.stack([lengths for _, lengths in parts])
