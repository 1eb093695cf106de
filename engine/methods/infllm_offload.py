"""offload: InfLLM-style context memory; cold KV lives in host memory, selected blocks are fetched.

Paper: Xiao et al., "InfLLM: Training-Free Long-Context Extrapolation for LLMs with an Efficient
Context Memory" (NeurIPS 2024); reference code thunlp/InfLLM ``inf_llm/attention/inf_llm.py``.
Rule: the context is cut into blocks (here: the cache's pages, ``page_size`` tokens of one
kv-head; InfLLM uses 128-token blocks, so set ``page_size`` accordingly). Each head keeps on the
device its initial tokens (``n_sink``, InfLLM's ``n_init``), its local window (``n_local``) and the
blocks it reads this step; every other full block is *cold*: it lives in the PagePool's host tier
(pinned memory on a CUDA machine) and its device page goes back to the pool. At each decode step a
block's relevance is ``q . r`` for its representative key ``r`` (the largest over the head's query
group) and each head fetches its ``topk`` most relevant blocks back for attention; the blocks it
no longer selects are dropped from the device again (their host copy stays, so dropping costs no
copy). Device pages per head therefore stay at ``sink + local + topk`` (+1 for the page being
written), whatever the context length.

Differences from the paper: the representative key of a block is the mean of all its keys
(InfLLM averages the ``repr_topk`` keys that received the most attention inside their local
window); selection is per kv-head (memory is head-granular here) rather than shared by a layer's
heads; the prompt is prefilled densely with every page on the device and the cold pages move out
at the first decode step (and back for the next turn's prefill).

Parameters:
    budget / budget_ratio   tokens per head attention reads (and the device holds) at each decode
                            step: sink + local + topk blocks; required
    n_sink = 64             initial tokens kept on the device (rounded up to pages; at most a quarter
                            of the budget)
    n_local = 256           recent tokens kept on the device (rounded up to pages; at most a quarter
                            of the budget)
    use_host = True         move cold blocks to the host tier; False keeps them on the device and
                            only restricts attention to the same blocks (to check the transfer)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.lifecycle import DecodeBatch, PrefillChunk, Selection, SparseMethod
from engine.method_spec import MethodError
from engine.methods.page_selection import PageSummaries, page_counts, select_pages
from engine.methods.registry import register


@dataclass
class OffloadParams:
    n_sink: int = 64
    n_local: int = 256
    use_host: bool = True


@register
class InfLLMOffload(SparseMethod):
    name = "offload"
    Params = OffloadParams
    needs_budget = True

    def __init__(self, spec, shape):
        super().__init__(spec, shape)
        if self.params.n_sink < 0 or self.params.n_local < 1:
            raise MethodError("offload: n_sink must be >= 0 and n_local >= 1")
        self.summaries = PageSummaries(("sum",), shape.page_size)

    def layout(self, num_tokens: int) -> tuple[int, int, int]:
        """(sink pages, local pages, total pages) a head reads for a context of ``num_tokens``."""
        P = self.shape.page_size
        budget = self.budget_for(num_tokens)
        sink = -(-min(self.params.n_sink, budget // 4) // P)
        local = max(1, -(-min(self.params.n_local, budget // 4) // P))
        total = max(-(-budget // P), sink + local)
        return sink, local, total

    def after_prefill_chunk(self, layer: int, chunk: PrefillChunk):
        self.summaries.update(chunk.seq_id, layer, chunk.lengths, chunk.k, chunk.cache)
        return None

    def decode_view(self, layer: int, batch: DecodeBatch) -> Selection | None:
        P = self.shape.page_size
        selected, cold = [], []
        for i, seq_id in enumerate(batch.seq_ids):
            lengths = batch.lengths[i]
            new_k = None if batch.k is None else batch.k[i : i + 1]
            sums = self.summaries.update(seq_id, layer, lengths, new_k, batch.cache)["sum"]  # [H, NP, D]
            counts = page_counts(lengths.to(sums.device), sums.shape[1], P)
            rep = sums / counts.clamp(min=1)[..., None]
            H = rep.shape[0]
            scores = torch.einsum("hgd,hpd->hgp", batch.q[i].float().view(H, -1, rep.shape[-1]), rep).amax(1)
            sink, local, total = self.layout(batch.num_tokens[i])
            sel = select_pages(scores, lengths, P, total, sink, local)
            selected.append(sel)
            if self.params.use_host:
                keep = torch.zeros(H, sums.shape[1] + 1, dtype=torch.bool, device=sel.device)
                keep.scatter_(1, torch.where(sel < 0, sums.shape[1], sel), True)
                p = torch.arange(sums.shape[1], device=sel.device)
                out = ~keep[:, :-1] & (counts > 0)  # every other page of the head goes (or stays) cold
                cold.append(torch.where(out, p, -1))
        sel = _stack(selected)
        return Selection(selected_pages=sel, to_host=_stack(cold) if cold else None)

    def fork_state(self, seq_id, child_id) -> None:
        self.summaries.fork(seq_id, child_id)

    def release(self, seq_id) -> None:
        self.summaries.release(seq_id)


def _stack(lists: list[torch.Tensor]) -> torch.Tensor:
    width = max(x.shape[-1] for x in lists)
    out = torch.full((len(lists), lists[0].shape[0], width), -1, dtype=torch.int64, device=lists[0].device)
    for i, x in enumerate(lists):
        out[i, :, : x.shape[-1]] = x
    return out
