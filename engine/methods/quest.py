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

Parameters:
    budget / budget_ratio   tokens each head attends per decode step (rounded up to pages); required
    dense_layers = 2        leading layers that stay dense (the paper skips the first two)
    n_sink_pages = 1        leading pages always attended
    n_recent_pages = 1      trailing pages always attended (the current page included)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.lifecycle import DecodeBatch, MethodError, PrefillChunk, Selection, SparseMethod
from engine.methods.page_selection import PageSummaries, select_pages


@dataclass
class QuestParams:
    dense_layers: int = 2
    n_sink_pages: int = 1
    n_recent_pages: int = 1


def page_scores(q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor) -> torch.Tensor:
    """Quest's bound for queries ``q`` ``[Hq, D]`` against page summaries ``[H, NP, D]``: the largest
    ``sum_d max(q_d M_d, q_d m_d)`` over each kv-head's query group, ``[H, NP]``. The sum splits
    by the sign of ``q_d``: ``q+ . M + q- . m``, two matrix products."""
    H = kmin.shape[0]
    qg = q.float().view(H, -1, q.shape[-1])  # [H, G, D]
    s = torch.einsum("hgd,hpd->hgp", qg.clamp(min=0), kmax) + torch.einsum("hgd,hpd->hgp", qg.clamp(max=0), kmin)
    return s.amax(1)


class Quest(SparseMethod):
    name = "quest"
    Params = QuestParams
    needs_budget = True

    def __init__(self, spec, shape):
        super().__init__(spec, shape)
        p = self.params
        if p.dense_layers < 0 or p.n_sink_pages < 0 or p.n_recent_pages < 1:
            raise MethodError("quest: dense_layers and n_sink_pages must be >= 0, n_recent_pages >= 1")
        self.summaries = PageSummaries(("amin", "amax"), shape.page_size)

    def pages_for(self, num_tokens: int) -> int:
        p = self.params
        P = self.shape.page_size
        return max(-(-self.budget_for(num_tokens) // P), p.n_sink_pages + p.n_recent_pages)

    def after_prefill_chunk(self, layer: int, chunk: PrefillChunk):
        if layer >= self.params.dense_layers:
            self.summaries.update(chunk.seq_id, layer, chunk.lengths, chunk.k, chunk.cache)
        return None

    def decode_view(self, layer: int, batch: DecodeBatch) -> Selection | None:
        if layer < self.params.dense_layers:
            return None
        p = self.params
        lists = []
        for i, seq_id in enumerate(batch.seq_ids):
            new_k = None if batch.k is None else batch.k[i : i + 1]
            s = self.summaries.update(seq_id, layer, batch.lengths[i], new_k, batch.cache)
            scores = page_scores(batch.q[i], s["amin"], s["amax"])
            lists.append(select_pages(scores, batch.lengths[i], self.shape.page_size,
                                      self.pages_for(batch.num_tokens[i]), p.n_sink_pages, p.n_recent_pages))
        width = max(x.shape[-1] for x in lists)
        out = torch.full((len(lists), lists[0].shape[0], width), -1, dtype=torch.int64, device=lists[0].device)
        for i, x in enumerate(lists):
            out[i, :, : x.shape[-1]] = x
        return Selection(selected_pages=out)

    def fork_state(self, seq_id, child_id) -> None:
        self.summaries.fork(seq_id, child_id)

    def release(self, seq_id) -> None:
        self.summaries.release(seq_id)
