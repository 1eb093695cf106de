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

Parameters:
    budget / budget_ratio    average tokens kept per (layer, kv-head); required
    scorer = "snapkv"        the method whose scores are ranked (with its default parameters)
    alpha_safeguard = 0.2    fraction of B every head keeps by its own ranking (the paper's 0.2)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from engine.lifecycle import MethodError, MethodSpec
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
        return topk_across_heads(scores, lengths, len(lengths) * budget,
                                 math.floor(self.params.alpha_safeguard * budget))
