"""omnikv: a few filter layers choose the tokens; the layers after each reuse its choice. Nothing is evicted.

Paper: Hao et al., "OmniKV: Dynamic Context Selection for Efficient Long-Context LLMs" (ICLR 2025);
reference code antgroup/OmniKV ``modeling/omnikv.py``.
Rule: the paper observes that the tokens a decode query attends most are much the same across
neighbouring layers. At each decode step the *filter layers* attend densely; their attention
probabilities for the step's query, summed over all query heads, rank the context, and the top
``budget`` tokens (the newest token always among them) become the set every layer after the filter
layer reads, up to the next filter layer. Layers before the first filter layer stay dense. Nothing
is evicted: the next step chooses again, so a token dropped now can come back.

Tokens are identified by their physical index, which is the same in every layer and head while
nothing is evicted; a sequence whose heads no longer line up (a pruned shared history) reads densely.
Decode probabilities are computed only at the filter layers.

Parameters:
    budget / budget_ratio   tokens the layers after a filter layer read per step; required
    filter_layers = "2,8,18"  the filter layers, comma-separated (those past the model's depth are ignored)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.lifecycle import DecodeBatch, Selection, SparseMethod
from engine.method_spec import MethodError
from engine.methods.registry import register


@dataclass
class OmniKVParams:
    filter_layers: str = "2,8,18"
    """Comma-separated layer indices (a list of ints is accepted too)."""


@register
class OmniKV(SparseMethod):
    name = "omnikv"
    Params = OmniKVParams
    needs_budget = True
    needs_decode_probs = True

    def __init__(self, spec, shape):
        super().__init__(spec, shape)
        given = self.params.filter_layers
        try:
            layers = sorted({int(x) for x in (given.split(",") if isinstance(given, str) else given) if str(x).strip()})
        except ValueError:
            raise MethodError(f"omnikv.filter_layers expects layer indices like 2,8,18, not {given!r}") from None
        if any(x < 0 for x in layers):
            raise MethodError("omnikv.filter_layers must be layer indices >= 0")
        self.filters = [x for x in layers if x < shape.num_layers]
        if not self.filters:
            raise MethodError(f"omnikv.filter_layers {layers} are all past the model's {shape.num_layers} layers")
        self._filter_set = set(self.filters)
        self._chosen: dict = {}  # seq_id -> (filter layer, [T] bool over physical tokens), this step's choice

    def needs_decode_probs_at(self, layer: int) -> bool:
        return layer in self._filter_set

    def decode_view(self, layer: int, batch: DecodeBatch) -> Selection | None:
        if layer <= self.filters[0] or layer in self._filter_set:
            return None
        B, H = batch.lengths.shape
        T = int(batch.lengths.max())
        mask = torch.ones(B, H, T, dtype=torch.bool, device=batch.q.device)
        for i, seq_id in enumerate(batch.seq_ids):
            chosen = self._chosen.get(seq_id)
            n = int(batch.lengths[i, 0])
            if chosen is None or chosen.numel() != n or not bool((batch.lengths[i] == n).all()):
                continue  # heads that do not line up read densely
            mask[i, :, :n] = chosen.to(mask.device)
        return Selection(token_mask=mask)

    def after_decode(self, layer: int, batch: DecodeBatch):
        if layer not in self._filter_set:
            return None
        for i, seq_id in enumerate(batch.seq_ids):
            n = int(batch.lengths[i].min())
            k = self.budget_for(batch.num_tokens[i])
            chosen = torch.zeros(n, dtype=torch.bool, device=batch.probs.device)
            if n <= k or not bool((batch.lengths[i] == n).all()):
                chosen[:] = True
            else:
                score = batch.probs[i, :, :n].float().sum(0)
                score[n - 1] = float("inf")  # the newest token is always read
                chosen[torch.topk(score, k).indices] = True
            self._chosen[seq_id] = chosen
        return None

    def release(self, seq_id) -> None:
        self._chosen.pop(seq_id, None)
