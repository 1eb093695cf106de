"""Sparse methods, one module each, registered by name (engine/methods/registry.py).

The same names are used in EngineConfig (``method``), the CLI (``--method``), gRPC ``method``
fields and YAML. ``describe()`` lists every method with its parameters for ``--help``. Importing
this package imports every method module (each registers itself with ``@register``).
"""

from __future__ import annotations

import importlib
import pkgutil

from engine.methods.registry import REGISTRY, create_method, describe, get_method_class, register

for _mod in pkgutil.iter_modules(__path__):  # helper modules are imported too (harmless)
    importlib.import_module(f"{__name__}.{_mod.name}")

__all__ = ["REGISTRY", "create_method", "describe", "get_method_class", "register"]
