"""tova: keep the tokens the latest query attends most, averaged over the layer's heads.

Paper: Oren et al., "Transformers are Multi-State RNNs" (TOVA: Token Omission Via Attention, 2024).
Rule: take the attention probabilities of the most recent query (the prompt's last token at the
end of a prefill, then each decoded token), average them over all query heads of the layer, and
keep the ``budget`` tokens with the highest average — the same tokens in every kv-head of the
layer. At every decode step past the budget the lowest-scored token is dropped. (Should a layer's
heads hold different tokens — e.g. a session compressed by another method earlier — the average
runs over each kv-head's own GQA group instead.)

Tensor parallelism: the mean runs over all query heads of the layer, which are split over ranks,
so scoring a layer is one all-reduce (sum) of the latest query's ``[T]`` probabilities summed over
the rank's heads, and whether a layer or a decode step is compressed at all is agreed with an
all-reduce (max) of the heads' lengths. The per-GQA-group fallback needs no communication.

Parameters:
    budget / budget_ratio   tokens kept per (layer, kv-head); required
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.distributed import group
from engine.lifecycle import ChunkInfo, DecodeBatch, PrefillChunk
from engine.methods.registry import register
from engine.methods.scored import ScoredEviction, group_mean, topk_per_head


def tova_scores(probs: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """``[Hq, T]`` probabilities of the latest query -> ``[H, T]`` scores (layer mean over heads)."""
    H = len(lengths)
    T = int(lengths.max())
    uniform = bool((lengths == lengths[0]).all())
    if not group.active():
        probs = probs[:, :T].float()
        return probs.mean(0, keepdim=True).expand(H, T) if uniform else group_mean(probs, H)
    # the layer's heads are on every rank: agree on the case and the width, then sum over ranks
    mine = T
    T, not_uniform = group.max_ints([T, int(not uniform)])
    uniform = not not_uniform
    probs = probs[:, :T].float()
    if probs.shape[-1] < T:
        probs = F.pad(probs, (0, T - probs.shape[-1]))
    if uniform:
        total = group.all_reduce_sum(probs.sum(0, keepdim=True))
        return (total / (probs.shape[0] * group.size())).expand(H, T)[:, :mine]
    return group_mean(probs, H)[:, :mine]


@register
class TOVA(ScoredEviction):
    name = "tova"
    needs_decode_probs = True
    spans_heads = True

    def probs_window(self, chunk: ChunkInfo) -> int:
        return 1

    def score(self, layer: int, chunk: PrefillChunk) -> torch.Tensor:
        return tova_scores(chunk.probs[:, -1], chunk.lengths)

    def decode_hooks_due(self, seq_ids, lengths) -> bool:
        return self.spec.budget is None or group.max_ints([int(lengths.max())])[0] > self.spec.budget

    def after_decode(self, layer: int, batch: DecodeBatch):
        out = {}
        longest = group.max_ints([int(n.max()) for n in batch.lengths])  # every rank's heads decide
        for i, seq_id in enumerate(batch.seq_ids):
            lengths, budget = batch.lengths[i], self.budget_for(batch.num_tokens[i])
            if longest[i] > budget:
                out[seq_id] = topk_per_head(tova_scores(batch.probs[i], lengths), lengths, [budget] * len(lengths))
        return out
