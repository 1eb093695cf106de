"""Sparse methods, one module each, and the registry that maps a method name to its class.

The same names are used in EngineConfig (``method``), the CLI (``--method``), gRPC ``method``
fields and YAML. ``describe()`` lists every method with its parameters for ``--help``.
"""

from __future__ import annotations

import dataclasses
import sys

from engine.lifecycle import MethodError, MethodSpec, ModelShape, SparseMethod
from engine.methods.adakv import AdaKV
from engine.methods.dense import Dense
from engine.methods.duo_attention import DuoAttention
from engine.methods.expected_attention import ExpectedAttention
from engine.methods.fp8 import FP8
from engine.methods.h2o import H2O
from engine.methods.infllm_offload import InfLLMOffload
from engine.methods.keydiff import KeyDiff
from engine.methods.kivi import KIVI
from engine.methods.kvzip import KVzip
from engine.methods.omnikv import OmniKV
from engine.methods.pyramidkv import PyramidKV
from engine.methods.quest import Quest
from engine.methods.rkv import RKV
from engine.methods.snapkv import SnapKV
from engine.methods.streaming_llm import StreamingLLM
from engine.methods.tova import TOVA

REGISTRY: dict[str, type[SparseMethod]] = {cls.name: cls for cls in (Dense, StreamingLLM)}
REGISTRY.update({cls.name: cls for cls in (H2O, TOVA, SnapKV, PyramidKV, AdaKV, KeyDiff, ExpectedAttention, RKV)})  # eviction family
REGISTRY.update({cls.name: cls for cls in (Quest, OmniKV, InfLLMOffload, DuoAttention)})  # selection, offload, head-level
REGISTRY.update({cls.name: cls for cls in (KIVI, FP8)})  # quantized KV layouts
REGISTRY[KVzip.name] = KVzip  # eviction family, scored by an extra pass (last: batch order of the others unchanged)


def get_method_class(name: str) -> type[SparseMethod]:
    try:
        return REGISTRY[name]
    except KeyError:
        raise MethodError(f"unknown method {name!r}; known: {', '.join(sorted(REGISTRY))}") from None


def create_method(spec: MethodSpec, shape: ModelShape) -> SparseMethod:
    return get_method_class(spec.method)(spec, shape)


def describe() -> str:
    """One line per method: name, summary, budget need and parameters with defaults."""
    lines = []
    for name in sorted(REGISTRY):
        cls = REGISTRY[name]
        doc = (sys.modules[cls.__module__].__doc__ or "").strip().splitlines()
        summary = doc[0].split(":", 1)[-1].strip() if doc else ""
        params = []
        if cls.Params is not None:
            for f in dataclasses.fields(cls.Params):
                default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
                params.append(f"{f.name}={default}")
        needs = " [needs --budget or --budget-ratio]" if cls.needs_budget else ""
        lines.append(f"  {name:<20} {summary}{needs}")
        if params:
            lines.append(f"  {'':<20}   --method-arg " + " ".join(params))
    return "\n".join(lines)


__all__ = ["REGISTRY", "create_method", "describe", "get_method_class"]
