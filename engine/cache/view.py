"""AttentionView: what one attention call, for one layer of a batch, may read.

Built by the runner from the CacheManager's page tables and the sparse methods' selections. The
attention backends (engine/attention/) read K/V only through a view, so a method changes what
attention sees by changing the view, never by touching pages.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionView:
    tables: torch.Tensor
    """``[B, H, num_pages]`` int32: each kv-head's page ids, in physical order (-1 past the end)."""
    lengths: torch.Tensor
    """``[B, H]`` int32: physical tokens each head holds (the chunk being prefilled included)."""
    page_size: int
    selected_pages: torch.Tensor | None = None
    """``[B, H, K]`` int64 indices into each head's page list that attention may read (-1 = none);
    None reads every page. Query-aware methods (Quest) and offload set it."""
    token_mask: torch.Tensor | None = None
    """``[B, H, T]`` bool over physical tokens that attention may read; None reads all."""

    @property
    def batch_size(self) -> int:
        return self.tables.shape[0]

    @property
    def num_pages(self) -> int:
        return self.tables.shape[-1]

    def readable(self) -> torch.Tensor:
        """``[B, H, num_pages * page_size]`` bool: the physical tokens this view lets attention read."""
        B, H, NP = self.tables.shape
        T = NP * self.page_size
        t = torch.arange(T, device=self.tables.device)
        mask = t[None, None, :] < self.lengths[..., None]
        if self.selected_pages is not None:
            sel = torch.zeros(B, H, NP + 1, dtype=torch.bool, device=self.tables.device)
            sp = self.selected_pages
            idx = torch.where((sp < 0) | (sp >= NP), NP, sp)
            sel.scatter_(-1, idx, True)
            mask &= sel[..., :NP].repeat_interleave(self.page_size, dim=-1)
        if self.token_mask is not None:
            tm = self.token_mask
            if tm.shape[-1] < T:
                tm = torch.nn.functional.pad(tm, (0, T - tm.shape[-1]))
            mask &= tm[..., :T]
        return mask
