"""PagePool: the physical KV memory, in head-granular pages, with a free list and reference counts.

A page holds ``page_size`` tokens of *one* kv-head of *one* layer: K ``[page_size, head_dim]``,
V ``[page_size, head_dim]`` and the original position of each token (int32). All layers share one
pool (every page has the same shape), so memory a method frees in any layer or head is usable by
any other sequence, layer or head at once.

The free list and the reference counts live on the host; allocation never synchronises with the
device. Reference counts make fork copy-on-write: a page goes back to the free list when its last
owner lets go of it.

How K/V are stored is the pool's *format* (engine/cache/formats.py): plain pages in the model dtype
(the default), or a quantized layout (FP8, KIVI) that a method declared. The pool delegates every
K/V read and write to it; ``k`` / ``v`` exist only for the plain format, which kernels read directly.
"""

from __future__ import annotations

import torch

from engine.cache.errors import OutOfPages
from engine.cache.formats import KVFormat, PlainFormat

__all__ = ["OutOfPages", "PagePool"]


class PagePool:
    def __init__(
        self,
        num_pages: int,
        page_size: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        format: KVFormat | None = None,
        max_open_pages: int = 0,
    ):
        """``max_open_pages``: staging pages for formats that keep partly filled and recent pages
        in full precision (KIVI); ``format.staging_per_head`` per cached (sequence, layer, kv-head)
        is always enough."""
        if num_pages < 1:
            raise ValueError(f"a page pool needs at least one page, not {num_pages}")
        self.num_pages = num_pages
        self.page_size = page_size
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = torch.device(device)
        self.format = format or PlainFormat(page_size, head_dim, dtype)
        if (self.format.page_size, self.format.head_dim, self.format.dtype) != (page_size, head_dim, dtype):
            raise ValueError("the page format was built for another page size, head_dim or dtype")
        self.format.allocate(num_pages, self.device, max_open_pages)
        self.pos = torch.zeros(num_pages, page_size, dtype=torch.int32, device=self.device)
        # a stack of free page ids; the top is at the end, so low ids are handed out first
        self._free = torch.arange(num_pages - 1, -1, -1, dtype=torch.int64)
        self._top = num_pages
        self.refcount = torch.zeros(num_pages, dtype=torch.int32)
        self._total_refs = 0  # sum of reference counts: more than the pages in use means some are shared
        self._derived: dict[str, object] = {}

    def derived(self, name: str, make):
        """Per-page state that methods derive from the pages' contents and keep beside the pool
        (quest's key bounds): built by ``make(pool)`` on first use, shared by every method instance
        that asks for ``name``. It is not counted in the pool's size."""
        store = self._derived.get(name)
        if store is None:
            store = self._derived[name] = make(self)
        return store

    # --- accounting --------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return self._top

    @property
    def num_used(self) -> int:
        return self.num_pages - self._top

    @property
    def has_shared(self) -> bool:
        """Is any page referenced more than once (a fork or a shared prefix)? O(1)."""
        return self._total_refs > self.num_used

    @property
    def bytes_per_page(self) -> int:
        """Bytes of one page: its format's K/V storage (codes, scales, zero points) + positions."""
        return self.format.bytes_per_page + self.page_size * self.pos.element_size()

    @property
    def storage_bytes(self) -> int:
        """Every byte the pool allocated: its format's tensors (staging included) and positions."""
        return self.format.storage_bytes + self.pos.numel() * self.pos.element_size()

    @property
    def bytes_per_token(self) -> float:
        """Bytes one token of the pool's capacity costs in one kv-head of one layer: all the
        pool's storage over ``num_pages * page_size`` (K + V + position, plus scales and the
        full-precision staging of quantized formats)."""
        return self.storage_bytes / (self.num_pages * self.page_size)

    def bytes_of(self, ids: torch.Tensor) -> int:
        """Bytes that the pages ``ids`` hold: each page's storage, plus a staging page for every
        staged (open or in the recent window, still full-precision) page of a quantized format."""
        ids = ids.reshape(-1)
        return ids.numel() * self.bytes_per_page + self.format.num_open(ids) * self.format.open_page_bytes

    # --- K/V data (delegated to the format) ----------------------------------------------------
    @property
    def k(self) -> torch.Tensor:
        if not self.format.plain:
            raise AttributeError(f"a {self.format.describe()} pool has no plain K tensor; read pages with read_pages")
        return self.format.k

    @property
    def v(self) -> torch.Tensor:
        if not self.format.plain:
            raise AttributeError(f"a {self.format.describe()} pool has no plain V tensor; read pages with read_pages")
        return self.format.v

    def write_tokens(self, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store K/V ``[M, D]`` (or ``[N, H, D]`` with slots ``[N, H]``) at flat token slots."""
        D = self.head_dim
        self.format.write(slots.reshape(-1), k.reshape(-1, D), v.reshape(-1, D))

    def read_pages(self, pages: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V of ``pages`` (int64, device) as ``[*pages.shape, page_size, D]`` in the model dtype."""
        return self.format.read_pages(pages)

    def read_tokens(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V ``[M, D]`` of flat token slots (model dtype)."""
        return self.format.read_tokens(slots)

    # --- allocation ----------------------------------------------------------------------------
    def alloc(self, n: int) -> torch.Tensor:
        """``n`` free page ids (int64, host), each with reference count 1."""
        if n > self._top:
            raise OutOfPages(f"asked for {n} pages, {self._top} free of {self.num_pages}")
        ids = self._free[self._top - n : self._top].flip(0).clone()
        self._top -= n
        self.refcount[ids] = 1
        self._total_refs += n
        return ids

    def incref(self, ids: torch.Tensor) -> None:
        ids = ids.reshape(-1).to(torch.int64)
        self.refcount.index_add_(0, ids, torch.ones_like(ids, dtype=torch.int32))
        self._total_refs += ids.numel()

    def decref(self, ids: torch.Tensor) -> int:
        """Drop one reference per id (ids may repeat); returns how many pages became free."""
        ids = ids.reshape(-1).to(torch.int64)
        if ids.numel() == 0:
            return 0
        self.refcount.index_add_(0, ids, torch.full_like(ids, -1, dtype=torch.int32))
        self._total_refs -= ids.numel()
        touched = ids.unique()
        counts = self.refcount[touched]
        if bool((counts < 0).any()):
            raise RuntimeError(f"page reference count below zero: pages {touched[counts < 0].tolist()[:8]}")
        freed = touched[counts == 0]
        self.format.release(freed)
        m = freed.numel()
        self._free[self._top : self._top + m] = freed
        self._top += m
        return m

    def copy_pages(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy whole pages (K, V, positions); used by copy-on-write."""
        src = src.to(self.device)
        dst = dst.to(self.device)
        self.format.copy_pages(src, dst)
        self.pos[dst] = self.pos[src]

    # --- host tier (offload methods) ---------------------------------------------------------------
    @property
    def has_host(self) -> bool:
        return getattr(self, "_host", None) is not None

    @property
    def host(self):
        """The HostTier beside this pool (created on first use): cold pages of offload methods."""
        if getattr(self, "_host", None) is None:
            from engine.cache.host_tier import HostTier

            self._host = HostTier(self.page_size, self.head_dim, self.dtype)
        return self._host
