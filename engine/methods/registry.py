"""The method registry: a method name (``EngineConfig.method``, ``--method``, gRPC ``method``, YAML)
to its class. A method module registers its class with the ``@register`` decorator; importing
``engine.methods`` imports every method module, so every method is registered."""

from __future__ import annotations

import dataclasses
import sys
from typing import TypeVar

from engine.lifecycle import ModelShape, SparseMethod
from engine.method_spec import MethodError, MethodSpec
from engine.methods.recall_variant import SUFFIX, RecallParams, base_name, recall_variant

REGISTRY: dict[str, type[SparseMethod]] = {}
"""Name -> class. Nothing depends on its order (``describe`` and tests sort it)."""

M = TypeVar("M", bound=type[SparseMethod])


def register(cls: M) -> M:
    """Class decorator: make ``cls`` available under ``cls.name``."""
    if not cls.name or cls.name in REGISTRY and REGISTRY[cls.name] is not cls:
        raise ValueError(f"method name {cls.name!r} is empty or already registered")
    REGISTRY[cls.name] = cls
    return cls


def get_method_class(name: str) -> type[SparseMethod]:
    """The class of a method name; ``<method>+recall`` is ``<method>`` with its evictions recallable
    (engine/methods/recall_variant.py)."""
    base = base_name(name) if isinstance(name, str) else None
    try:
        return recall_variant(REGISTRY[base]) if base is not None else REGISTRY[name]
    except (KeyError, TypeError):
        raise MethodError(
            f"unknown method {name!r}; known: {', '.join(sorted(REGISTRY))} (an evicting one may end in {SUFFIX!r})"
        ) from None


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
    lines.append(
        f"  {'<method>' + SUFFIX:<20} an evicting method whose evictions stay recallable in host memory"
        " (engine/methods/recall_variant.py)"
    )
    recall = " ".join(f"{f.name}={f.default}" for f in dataclasses.fields(RecallParams))
    lines.append(f"  {'':<20}   --method-arg {recall}")
    return "\n".join(lines)
