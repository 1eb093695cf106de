"""pyramidkv: SnapKV's score with per-layer budgets that fall from the bottom layers to the top.

Paper: Cai et al., "PyramidKV: Dynamic KV Cache Compression based on Pyramidal Information
Funneling" (2024).
Rule: tokens are scored as in SnapKV (window attention, pooling, GQA mean; the window is kept).
Per-layer budgets follow kvpress' PyramidKVPress (the reference our fidelity checks use), whose
formula is the paper code's (KVCache-Factory ``PyramidKVCluster``) with its capacity set to
``window + B``, ``B`` the average tokens kept per head (``budget``, or ``budget_ratio`` times the
context, unrounded): the top layer gets ``min = B / beta``, the bottom layer ``max = 2 B - min``;
when ``max >= context - window`` it is capped there and ``min = 2 B - max``; layer ``l`` keeps
``round(max - l (max - min) / (L - 1))`` tokens, the window included. Unless
``context >= max >= min >= window``, every layer keeps ``round(B)`` (SnapKV): with the defaults
(window 64, beta 20) that is every budget below 1280 tokens.

How this differs from the paper's code: KVCache-Factory keeps ``line + window`` per layer, its
line built over ``B - window`` with integer division, and falls back to SnapKV only while the
context is shorter than ``2 (B - window)``. kvpress folds the window into the line (so the layers
average ``B``) and falls back whenever the top layer would keep fewer tokens than the window.
An earlier version here followed the paper code's shape with rounding of its own; its kept
tokens differed from kvpress' at every budget where kvpress falls back to SnapKV.

Tensor parallelism: no communication. The allocation is across layers, not heads, and is computed
from values every rank has (layers, budget, window, context length); each kv-head ranks its own
tokens as in snapkv.

Parameters:
    budget / budget_ratio   average tokens kept per (layer, kv-head), window included; required
    window_size = 64        observation window (kvpress' default)
    kernel_size = 5         pooling kernel
    pooling = "avgpool"     ``avgpool`` or ``maxpool``
    beta = 20               ratio of the bottom to the top layer's budget scale (the paper's default; >= 1)
    decode_interval = 0     SnapKV's parameter; must stay 0 (per-layer budgets apply at the prompt's end)
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.method_spec import MethodError
from engine.methods.registry import register
from engine.methods.snapkv import SnapKV, SnapKVParams


@dataclass
class PyramidKVParams(SnapKVParams):
    beta: int = 20


def pyramid_budgets(num_layers: int, budget: float, window: int, context: int, beta: float) -> list[int]:
    """Tokens kept per head in each layer (bottom first), window included, by kvpress'
    PyramidKVPress rule; ``budget`` is the average per head (a float when it comes from a ratio)."""
    uniform = [round(budget)] * num_layers
    if num_layers == 1:
        return uniform
    lo = budget / beta
    hi = 2 * budget - lo
    if hi >= context - window:
        hi = context - window
        lo = 2 * budget - hi
    if not (context >= hi >= lo >= window):
        return uniform
    step = (hi - lo) / (num_layers - 1)
    return [round(hi - layer * step) for layer in range(num_layers)]


@register
class PyramidKV(SnapKV):
    name = "pyramidkv"
    Params = PyramidKVParams

    def __init__(self, spec, shape):
        super().__init__(spec, shape)
        if self.params.beta < 1:
            raise MethodError(f"pyramidkv.beta must be >= 1, not {self.params.beta}")
        if self.params.decode_interval:
            raise MethodError("pyramidkv compresses at the end of a prompt only (decode_interval must be 0)")

    def average_budget(self, num_tokens: int) -> float:
        """``B``: the budget, or the ratio times the context unrounded (kvpress' ``q_len * (1 - cr)``)."""
        if self.spec.budget_ratio is not None:
            return self.spec.budget_ratio * num_tokens
        return float(self.budget_for(num_tokens))

    def layer_budgets(self, layer: int, lengths, num_tokens: int) -> list[int]:
        budgets = pyramid_budgets(
            self.shape.num_layers,
            self.average_budget(num_tokens),
            self.params.window_size,
            int(lengths.max()),
            self.params.beta,
        )
        return [max(1, budgets[layer])] * len(lengths)
