"""Page formats: how a PagePool stores the K/V of its pages (plain, FP8, KIVI 2/4-bit), by name.

A sparse method declares the layout it wants (``SparseMethod.kv_layout()``, a ``KVLayout``: a
format name and its parameters); ``make_format`` builds the matching format for the model's page
size, head_dim and dtype, and the engine hands it to the PagePool. The interface every format
implements, and how formats are accounted for, is ``engine/cache/format_base.py`` (``KVFormat``).

Formats:

``plain``  K and V ``[num_pages, page_size, head_dim]`` in the model dtype (``PlainFormat``, here).
           The Triton kernels and CUDA graphs read these tensors directly (``plain = True``).
``fp8``    float8 codes with a float16 scale per token and kv-head (engine/cache/format_fp8.py).
``kivi``   KIVI: 2/4-bit keys per channel and values per token, the most recent tokens in a
           full-precision window (engine/cache/format_kivi.py).
"""

from __future__ import annotations

from typing import Any

import torch

from engine.cache.format_base import FormatError, KVFormat
from engine.cache.format_fp8 import FP8Format
from engine.cache.format_kivi import KIVIFormat


class PlainFormat(KVFormat):
    """K and V in the model dtype, unquantized: the kernels read ``k`` / ``v`` directly."""

    name = "plain"
    plain = True

    def allocate(self, num_pages, device, max_open_pages=0):
        shape = (num_pages, self.page_size, self.head_dim)
        self.k = torch.zeros(shape, dtype=self.dtype, device=device)
        self.v = torch.zeros(shape, dtype=self.dtype, device=device)

    @property
    def bytes_per_page(self) -> int:
        return 2 * self.page_size * self.head_dim * torch.empty((), dtype=self.dtype).element_size()

    def _tensors(self):
        return [self.k, self.v]

    def write(self, slots, k, v):
        D = self.head_dim
        idx = slots.reshape(-1)
        self.k.view(-1, D).index_copy_(0, idx, k.reshape(-1, D).to(self.dtype))
        self.v.view(-1, D).index_copy_(0, idx, v.reshape(-1, D).to(self.dtype))

    def read_pages(self, pages):
        return self.k[pages], self.v[pages]

    def read_tokens(self, slots):
        D = self.head_dim
        return self.k.view(-1, D)[slots], self.v.view(-1, D)[slots]

    @property
    def moved_token_bytes(self) -> int:
        return 2 * self.head_dim * torch.empty((), dtype=self.dtype).element_size()

    def take_tokens(self, slots):
        return self.read_tokens(slots)

    def put_tokens(self, slots, data):
        D = self.head_dim
        self.k.view(-1, D)[slots] = data[0]
        self.v.view(-1, D)[slots] = data[1]

    def copy_pages(self, src, dst):
        self.k[dst] = self.k[src]
        self.v[dst] = self.v[src]


FORMATS: dict[str, type[KVFormat]] = {cls.name: cls for cls in (PlainFormat, FP8Format, KIVIFormat)}


def make_format(name: str, args: dict[str, Any] | tuple, page_size: int, head_dim: int, dtype: torch.dtype) -> KVFormat:
    """The page format a method's ``KVLayout`` names, for this model's page size, head_dim and dtype."""
    try:
        cls = FORMATS[name]
    except KeyError:
        raise FormatError(f"unknown KV page format {name!r}; known: {', '.join(sorted(FORMATS))}") from None
    try:
        return cls(page_size, head_dim, dtype, **dict(args))
    except TypeError as e:
        raise FormatError(f"KV page format {name!r}: {e}") from None


__all__ = ["FORMATS", "FP8Format", "FormatError", "KIVIFormat", "KVFormat", "PlainFormat", "make_format"]
