"""dense: the pass-through method. Every token stays; attention reads the whole cache.

Paper: none (the baseline every sparse method is compared against).
Rule: keep everything. Parameters: none.
"""

from __future__ import annotations

from engine.lifecycle import SparseMethod
from engine.methods.registry import register


@register
class Dense(SparseMethod):
    name = "dense"
