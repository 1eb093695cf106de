"""fp8: KV cache stored as 8-bit floats with a scale per token.

Paper: Micikevicius et al., "FP8 Formats for Deep Learning" (2022); FP8 KV caches as in vLLM /
TensorRT-LLM ("fp8_e4m3" KV cache with scales).
Rule: every token's K and V (per kv-head) are scaled by absmax / the format's largest value
(448 for e4m3, 57344 for e5m2) and stored as float8 codes with a float16 scale; attention reads
them dequantized. Nothing is evicted. Each token is self-contained, so eviction and pruning move
tokens without loss. The pages live in the ``fp8`` page format (engine/cache/format_fp8.py).

Parameters:
    fp8 = "e4m3"        e4m3 (more mantissa, the usual KV choice) or e5m2 (more range)
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.lifecycle import KVLayout, SparseMethod
from engine.method_spec import MethodError
from engine.methods.registry import register


@dataclass
class FP8Params:
    fp8: str = "e4m3"


@register
class FP8(SparseMethod):
    name = "fp8"
    Params = FP8Params

    def __init__(self, spec, shape):
        super().__init__(spec, shape)
        if self.params.fp8 not in ("e4m3", "e5m2"):
            raise MethodError(f"fp8.fp8 must be e4m3 or e5m2, not {self.params.fp8!r}")
        if spec.budget is not None or spec.budget_ratio is not None:
            raise MethodError("fp8 keeps every token (quantized) and takes no budget")

    def kv_layout(self) -> KVLayout:
        return KVLayout("fp8", (("fp8", self.params.fp8),))
