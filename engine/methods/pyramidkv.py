"""pyramidkv: SnapKV's score with per-layer budgets that fall from the bottom layers to the top.

Paper: Cai et al., "PyramidKV: Dynamic KV Cache Compression based on Pyramidal Information
Funneling" (2024).
Rule: tokens are scored as in SnapKV (window attention, pooling, GQA mean; the window is kept).
The budget beyond the window, ``B - w`` per head on average, is spread over the layers along a
line: the top layer gets ``min = (B - w) / beta``, the bottom layer ``max = 2 (B - w) - min``
(capped at the context: then ``min = 2 (B - w) - max``), the layers in between linearly, so the
layers' budgets add up to exactly ``num_layers * B`` (rounded by largest remainder). Every kv-head
of a layer keeps the layer's budget; the freed pages go back to the pool.

Tensor parallelism: no communication. The allocation is across layers, not heads, and is computed
from values every rank has (layers, budget, window, context length); each kv-head ranks its own
tokens as in snapkv.

Parameters:
    budget / budget_ratio   average tokens kept per (layer, kv-head), window included; required
    window_size = 64        observation window (kvpress' default)
    kernel_size = 5         pooling kernel
    pooling = "avgpool"     ``avgpool`` or ``maxpool``
    beta = 20               ratio of the bottom to the top layer's budget scale (the paper's default)
    decode_interval = 0     SnapKV's parameter; must stay 0 (per-layer budgets apply at the prompt's end)
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.lifecycle import MethodError
from engine.methods.registry import register
from engine.methods.scored import split_evenly
from engine.methods.snapkv import SnapKV, SnapKVParams


@dataclass
class PyramidKVParams(SnapKVParams):
    beta: int = 20


def pyramid_budgets(num_layers: int, budget: int, window: int, context: int, beta: float) -> list[int]:
    """Tokens per head for each layer (bottom first), window included; they add up to
    ``num_layers * budget`` (when the context allows)."""
    window = min(window, budget)
    spare = budget - window
    if num_layers == 1 or spare == 0:
        return [budget] * num_layers
    lo = spare / beta
    hi = 2 * spare - lo
    room = max(context - window, 0)
    if hi > room:
        hi = room
        lo = max(2 * spare - hi, 0)
    line = [hi - (hi - lo) * layer / (num_layers - 1) for layer in range(num_layers)]
    total = min(num_layers * spare, round(sum(line)))
    return [window + b for b in split_evenly(total, line)]


@register
class PyramidKV(SnapKV):
    name = "pyramidkv"
    Params = PyramidKVParams

    def __init__(self, spec, shape):
        super().__init__(spec, shape)
        if self.params.beta <= 0:
            raise MethodError(f"pyramidkv.beta must be > 0, not {self.params.beta}")
        if self.params.decode_interval:
            raise MethodError("pyramidkv compresses at the end of a prompt only (decode_interval must be 0)")

    def layer_budgets(self, layer: int, lengths, num_tokens: int) -> list[int]:
        budgets = pyramid_budgets(self.shape.num_layers, self.budget_for(num_tokens), self.params.window_size,
                                  int(lengths.max()), self.params.beta)
        return [budgets[layer]] * len(lengths)
