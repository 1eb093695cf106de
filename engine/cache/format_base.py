"""The page-format interface: how a PagePool delegates every read and write of K/V (``KVFormat``).

A sparse method declares the layout it wants (``SparseMethod.kv_layout()``, a ``KVLayout``); the
engine builds the matching format (``engine.cache.formats.make_format``) and hands it to the
PagePool, which delegates every read and write of K/V to it. Nothing outside the format's own
module knows how a quantized page is laid out: the attention backends read pages through
``read_pages`` (dequantize-then-attend) and write new tokens through ``write``; the CacheManager
moves tokens (eviction compaction), copies pages (copy-on-write) and snapshots tokens through the
same calls.

Accounting. ``bytes_per_page`` is what a page's own storage costs (codes, scales, zero points);
``open_page_bytes`` is what a staged (open or in-window) page costs on top (its staging page); ``storage_bytes`` is
every byte the format allocated. ``PagePool.bytes_of(pages)`` adds them up for a set of pages, so
a sequence's cost counts its full-precision window where it really has one.
"""

from __future__ import annotations

from typing import Any

import torch


class FormatError(ValueError):
    """A page format with parameters it cannot support."""


class KVFormat:
    """Base class: the interface the PagePool delegates to."""

    name = ""
    plain = False
    """True only for the plain layout: kernels may read ``k`` / ``v`` directly."""

    def __init__(self, page_size: int, head_dim: int, dtype: torch.dtype):
        self.page_size = page_size
        self.head_dim = head_dim
        self.dtype = dtype
        self.args: dict[str, Any] = {}

    # --- layout ---------------------------------------------------------------------------------
    def allocate(self, num_pages: int, device: torch.device, max_open_pages: int = 0) -> None:
        raise NotImplementedError

    @property
    def key(self) -> tuple:
        """Identity of the layout (name and parameters): sessions of one pool must agree on it."""
        return (self.name, tuple(sorted(self.args.items())))

    def describe(self) -> str:
        args = ", ".join(f"{k}={v}" for k, v in sorted(self.args.items()))
        return f"{self.name}({args})" if args else self.name

    @property
    def bytes_per_page(self) -> int:
        """Bytes of one page's K/V storage (codes, scales and zero points; positions not included)."""
        raise NotImplementedError

    open_page_bytes = 0
    """Extra bytes a staged (open or in the full-precision window, not yet quantized) page holds."""

    staging_per_head = 0
    """Staging pages one (sequence, layer, kv-head) can hold at once (0: the format stages nothing)."""

    residual_length = 0
    """Most recent tokens of a head kept in full precision (the CacheManager ``expire``s pages past them)."""

    def _tensors(self) -> list[torch.Tensor]:
        raise NotImplementedError

    @property
    def storage_bytes(self) -> int:
        """Every byte this format allocated (pages and staging)."""
        return sum(t.numel() * t.element_size() for t in self._tensors())

    def num_open(self, pages: torch.Tensor) -> int:
        """How many of ``pages`` hold a staging page (open or in the full-precision window)."""
        return 0

    def expire(self, pages: torch.Tensor, filled: torch.Tensor) -> None:
        """``pages`` (host int64) left their head's full-precision window. Those with ``filled``
        (host bool) are full already; the others get their last token in the coming write. Each is
        quantized once full."""

    # --- data -----------------------------------------------------------------------------------
    def write(self, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store tokens: ``k``, ``v`` ``[M, D]`` at flat token slots ``[M]`` (page * page_size + offset)."""
        raise NotImplementedError

    def read_pages(self, pages: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V of ``pages`` (any shape S, int64 on the device) as ``[*S, page_size, D]`` in the model dtype."""
        raise NotImplementedError

    def read_tokens(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V ``[M, D]`` (model dtype) of flat token slots ``[M]``."""
        P = self.page_size
        if slots.numel() == 0:
            empty = torch.empty(0, self.head_dim, dtype=self.dtype, device=slots.device)
            return empty, empty.clone()
        pages, inv = torch.unique(slots // P, return_inverse=True)
        k, v = self.read_pages(pages)
        off = slots % P
        return k[inv, off], v[inv, off]

    @property
    def moved_token_bytes(self) -> int:
        """Working memory one token moved by ``take_tokens`` / ``put_tokens`` takes (eviction compaction
        sizes its chunks by it). Here: the pages the token is read from and written to, dequantized to
        float32 with their temporaries; a format that moves tokens in their stored form says less."""
        return 8 * self.head_dim * 4

    def take_tokens(self, slots: torch.Tensor) -> Any:
        """The stored form of tokens, for ``put_tokens`` (eviction compaction moves tokens)."""
        return self.read_tokens(slots)

    def put_tokens(self, slots: torch.Tensor, data: Any) -> None:
        self.write(slots, *data)

    def copy_pages(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy whole pages (copy-on-write); ``dst`` are freshly allocated pages."""
        raise NotImplementedError

    def release(self, pages: torch.Tensor) -> None:
        """``pages`` went back to the free list (host int64)."""


__all__ = ["FormatError", "KVFormat"]
