"""kivi: KV cache quantized to 2 or 4 bits, keys per channel and values per token.

Paper: Liu et al., "KIVI: A Tuning-Free Asymmetric 2bit Quantization for KV Cache" (ICML 2024).
Rule: keys are quantized per channel (their outliers sit in fixed channels), in groups of tokens;
values per token, in groups of channels; both asymmetric (scale and zero point) to ``bits`` bits.
The most recent tokens stay in full precision (KIVI's residual, R tokens). The key group is a page
(G = page_size tokens per channel; the engine's default page is 16, so ``--page-size 32`` gives the
paper's G = 32); a page is quantized ("sealed") once it is full and all its tokens are at least
``residual_length`` tokens old, so the last R to R + page_size - 1 tokens of every head are
attended exactly (KIVI keeps its last R values exact, and keys until a group of them fills).
Attention reads dequantized K/V. Nothing is evicted: every token stays, in fewer bits. Scales and
zero points are float16; the pages live in the ``kivi`` page format (engine/cache/format_kivi.py).
The paper's defaults: 2 bits, group size G = 32, residual length R = 128.

Prefill: a chunk attends its own K/V in full precision and the earlier chunks as stored (the
window exact, older pages dequantized). KIVI prefills the whole prompt in full precision, so a
prompt longer than ``prefill_chunk_size`` reads somewhat more quantized context here than in the
paper (SmolLM2, 336-token prompt, 2 bits, R = 128: 0.84 agreement with 128-token chunks, 0.875
with one chunk; tests/test_quant_methods.py).

Memory: each head holds up to 1 + ceil(R / page_size) full-precision staging pages in the model
dtype on top of its quantized pages, so the bytes per cached token approach the quantized cost
only once the context is long against R (the pool's accounting counts the staging honestly).

Parameters:
    bits = 2            2 or 4 bits per key/value element
    value_group = 32    channels that share one value scale/zero point (per token); divides head_dim
    residual_length = 128  most recent tokens per head kept in full precision (KIVI's R); 0 keeps
                        only the open (partly filled) page
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.lifecycle import KVLayout, SparseMethod
from engine.method_spec import MethodError
from engine.methods.registry import register


@dataclass
class KIVIParams:
    bits: int = 2
    value_group: int = 32
    residual_length: int = 128


@register
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
        if p.residual_length < 0:
            raise MethodError(f"kivi.residual_length must be >= 0, not {p.residual_length}")
        if shape.page_size < 2:
            raise MethodError("kivi quantizes keys over the tokens of a page: page_size must be at least 2")
        if spec.budget is not None or spec.budget_ratio is not None:
            raise MethodError("kivi keeps every token (quantized) and takes no budget")

    def kv_layout(self) -> KVLayout:
        p = self.params
        return KVLayout(
            "kivi", (("bits", p.bits), ("value_group", p.value_group), ("residual_length", p.residual_length))
        )
