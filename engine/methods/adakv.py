"""adakv: adaptive per-head budgets over any scorer — one top-k across the heads of a layer.

Paper: Feng et al., "Ada-KV: Optimizing KV Cache Eviction by Adaptive Budget Allocation for
Efficient LLM Inference" (2024).
Rule: a wrapper. The inner method (``scorer``, any prefill-end scoring method: snapkv, tova,
keydiff, expected_attention, h2o, ...) scores every token of every kv-head of a layer. Each head
first keeps its own ``floor(alpha_safeguard * B)`` best tokens (the safeguard), then one top-k over
the remaining scores of all heads of the layer fills the layer's total of ``num_kv_heads * B``.
Heads whose attention is concentrated give tokens to heads whose attention is spread, so each
head keeps a different number of tokens — and, unlike kvpress (which masks), the pages of what a
head drops are freed. The layer's heads add up to exactly ``num_kv_heads * B``.

Tensor parallelism: the top-k runs over all kv-heads of the layer, which are split over ranks, so
each compression all-gathers the layer's ``[H, T]`` scores and head lengths; every rank then
makes the same selection and keeps its own heads' part. Whether a layer is compressed at all is
agreed with an all-reduce, and the inner scorer's own communication (tova's) comes on top.

Parameters:
    budget / budget_ratio    average tokens kept per (layer, kv-head); required
    scorer = "snapkv"        the method whose scores are ranked (with its default parameters)
    alpha_safeguard = 0.2    fraction of B every head keeps by its own ranking (the paper's 0.2)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.distributed import group
from engine.method_spec import MethodError, MethodSpec
from engine.methods.registry import get_method_class, register
from engine.methods.scored import ScoredEviction, topk_across_heads


@dataclass
class AdaKVParams:
    scorer: str = "snapkv"
    alpha_safeguard: float = 0.2


@register
class AdaKV(ScoredEviction):
    name = "adakv"
    Params = AdaKVParams
    spans_heads = True

    def __init__(self, spec, shape):
        super().__init__(spec, shape)
        cls = get_method_class(self.params.scorer)
        if not issubclass(cls, ScoredEviction) or cls is AdaKV:
            raise MethodError(f"adakv.scorer must be a scoring eviction method, not {self.params.scorer!r}")
        if not 0 <= self.params.alpha_safeguard <= 1:
            raise MethodError(f"adakv.alpha_safeguard must be in [0, 1], not {self.params.alpha_safeguard}")
        self.scorer = cls(MethodSpec(self.params.scorer, spec.budget, spec.budget_ratio), shape)
        """The wrapped method: its rule scores the tokens and keeps the per-sequence state."""

    @property
    def rule(self) -> ScoredEviction:
        return self.scorer

    def score(self, layer, chunk):
        return self.scorer.score(layer, chunk)

    # Ada-KV's allocation
    def select(self, layer, scores, lengths, num_tokens):
        budget = self.budget_for(num_tokens)
        floor = math.floor(self.params.alpha_safeguard * budget)
        if not group.active():
            return topk_across_heads(scores, lengths, len(lengths) * budget, floor)
        H = len(lengths)  # this rank's heads; the layer's are on every rank
        T = group.max_ints([scores.shape[-1]])[0]
        scores = F.pad(scores.float(), (0, T - scores.shape[-1]), value=float("-inf"))
        every = group.all_gather_first(scores)
        every_len = group.all_gather_first(lengths.to(scores.device, torch.int64)).cpu()
        keep = topk_across_heads(every, every_len, len(every_len) * budget, floor)
        return keep[group.rank() * H : (group.rank() + 1) * H]
