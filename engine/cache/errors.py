"""Errors of the cache layer (shared by the pool, its page formats and the cache manager)."""

from __future__ import annotations


class OutOfPages(RuntimeError):
    """More pages (or cache slots, or staging pages) were asked for than are free."""
