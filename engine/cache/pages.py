"""PagePool: the physical KV memory, in head-granular pages, with a free list and reference counts.

A page holds ``page_size`` tokens of *one* kv-head of *one* layer: K ``[page_size, head_dim]``,
V ``[page_size, head_dim]`` and the original position of each token (int32). All layers share one
pool (every page has the same shape), so memory a method frees in any layer or head is usable by
any other sequence, layer or head at once.

The free list and the reference counts live on the host; allocation never synchronises with the
device. Reference counts make fork copy-on-write: a page goes back to the free list when its last
owner lets go of it.
"""

from __future__ import annotations

import torch


class OutOfPages(RuntimeError):
    """More pages were asked for than the pool has free."""


class PagePool:
    def __init__(self, num_pages: int, page_size: int, head_dim: int, dtype: torch.dtype, device: torch.device):
        if num_pages < 1:
            raise ValueError(f"a page pool needs at least one page, not {num_pages}")
        self.num_pages = num_pages
        self.page_size = page_size
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = torch.device(device)
        self.k = torch.zeros(num_pages, page_size, head_dim, dtype=dtype, device=self.device)
        self.v = torch.zeros(num_pages, page_size, head_dim, dtype=dtype, device=self.device)
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
        elem = self.k.element_size()
        return 2 * self.page_size * self.head_dim * elem + self.page_size * self.pos.element_size()

    @property
    def bytes_per_token(self) -> float:
        """Bytes one cached token costs in one kv-head of one layer (K + V + position)."""
        return self.bytes_per_page / self.page_size

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
        m = freed.numel()
        self._free[self._top : self._top + m] = freed
        self._top += m
        return m

    def copy_pages(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy whole pages (K, V, positions); used by copy-on-write."""
        src = src.to(self.device)
        dst = dst.to(self.device)
        self.k[dst] = self.k[src]
        self.v[dst] = self.v[src]
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
