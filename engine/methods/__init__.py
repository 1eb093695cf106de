"""Sparse methods, one module each, and the registry that maps a method name to its class.

The same names are used in EngineConfig (``method``), the CLI (``--method``), gRPC ``method``
fields and YAML. ``describe()`` lists every method with its parameters for ``--help``.
"""

from __future__ import annotations

import dataclasses
import sys

from engine.lifecycle import MethodError, MethodSpec, ModelShape, SparseMethod
from engine.methods.dense import Dense
from engine.methods.fp8 import FP8
from engine.methods.kivi import KIVI
from engine.methods.streaming_llm import StreamingLLM

REGISTRY: dict[str, type[SparseMethod]] = {cls.name: cls for cls in (Dense, StreamingLLM, KIVI, FP8)}


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
