"""kivi: KV cache quantized to 2 or 4 bits, keys per channel and values per token.

Paper: Liu et al., "KIVI: A Tuning-Free Asymmetric 2bit Quantization for KV Cache" (ICML 2024).
Rule: keys are quantized per channel (their outliers sit in fixed channels), in groups of tokens;
values per token, in groups of channels; both asymmetric (scale and zero point) to ``bits`` bits.
The most recent tokens stay in full precision until a whole group of them can be quantized.
Here the token group is a page: a head's partly filled last page is the full-precision window
(up to ``page_size - 1`` tokens; KIVI's G = R = page_size, so use ``--page-size 32`` for the
paper's G = 32) and a page is quantized the moment its last token is written. Attention reads
dequantized K/V. Nothing is evicted: every token stays, in fewer bits. Scales and zero points
are float16; the pages live in the ``kivi`` page format (engine/cache/formats.py).

Parameters:
    bits = 2            2 or 4 bits per key/value element
    value_group = 32    channels that share one value scale/zero point (per token); divides head_dim
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.lifecycle import KVLayout, MethodError, SparseMethod


@dataclass
class KIVIParams:
    bits: int = 2
    value_group: int = 32


class KIVI(SparseMethod):
    name = "kivi"
    Params = KIVIParams

    def __init__(self, spec, shape):
        super().__init__(spec, shape)
        p = self.params
        if p.bits not in (2, 4):
            raise MethodError(f"kivi.bits must be 2 or 4, not {p.bits}")
        if p.value_group < 1 or shape.head_dim % p.value_group:
            raise MethodError(f"kivi.value_group ({p.value_group}) must divide head_dim ({shape.head_dim})")
        if shape.page_size < 2:
            raise MethodError("kivi quantizes keys over the tokens of a page: page_size must be at least 2")
        if spec.budget is not None or spec.budget_ratio is not None:
            raise MethodError("kivi keeps every token (quantized) and takes no budget")

    def kv_layout(self) -> KVLayout:
        return KVLayout("kivi", (("bits", self.params.bits), ("value_group", self.params.value_group)))
