"""The copies to the host a ColdStore has queued and not yet written into its host arrays.

A capture's values reach the host on the copier's side stream (engine/cache/cold_copy.py); each
``PendingWrite`` says where in the store (flat token slots, and the blocks they fill) they go.
``poll`` hands the copies that have run to the copier's writer thread and forgets those written,
never waiting; ``flush`` writes (or waits for the writes of) the copies a reader needs now; and
``discard`` lets every buffer go once its copy has run. The store's own ``write`` does the
writing (engine/cache/cold_store.py).
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass
from functools import partial
from typing import Callable, Iterator

import torch

from engine.cache.cold_copy import ColdCopier, HostCopy


@dataclass
class PendingWrite:
    """Values copied to the host, to be written at token slots ``flat`` (row * capacity + slot)."""

    copy: HostCopy
    flat: torch.Tensor
    blocks: torch.Tensor
    """The blocks (row * num_blocks + block) the values go to."""
    writing: Future | None = None
    """The writer thread's write of the values, once the copy has run."""


class PendingWrites:
    def __init__(self, copier: ColdCopier, write: Callable[[PendingWrite], None]):
        self.copier = copier
        self.write = write
        self.items: list[PendingWrite] = []
        """In the order they were queued."""

    def __len__(self) -> int:
        return len(self.items)

    def __iter__(self) -> Iterator[PendingWrite]:
        return iter(self.items)

    def add(self, copy: HostCopy, flat: torch.Tensor, blocks: torch.Tensor) -> None:
        self.items.append(PendingWrite(copy, flat, blocks))

    @property
    def buffers(self) -> int:
        """Pinned buffers the copies not yet written hold (0 without CUDA)."""
        return sum(p.copy.buffers for p in self.items)

    def poll(self) -> None:
        """Hand the copies that have run to the writer thread, and forget those it has written
        (never waits; without a writer thread the values are written now)."""
        left = []
        for p in self.items:
            if p.writing is None and p.copy.ready:
                p.copy.device = []  # the copy has read them: back to the allocator, on this thread
                p.writing = self.copier.write(partial(self.write, p))
                if p.writing is None:
                    continue
            if p.writing is not None and p.writing.done():
                p.writing.result()  # a write that failed fails here
                continue
            left.append(p)
        self.items = left

    def flush(self, blocks: torch.Tensor | None = None) -> None:
        """Wait for the copies and write them (only those into ``blocks``, host ``[n]``
        row * num_blocks + block, if given)."""
        if blocks is None:
            todo, self.items = self.items, []
        else:
            hit = [bool(torch.isin(p.blocks, blocks).any()) for p in self.items]
            todo = [p for p, h in zip(self.items, hit) if h]
            self.items = [p for p, h in zip(self.items, hit) if not h]
        for p in todo:
            if p.writing is None:
                self.write(p)  # the engine thread needs the values now
            else:
                p.writing.result()

    def discard(self) -> None:
        """Drop every copy (waiting for those in flight, and for writes under way)."""
        for p in self.items:
            if p.writing is not None:
                p.writing.result()
            p.copy.discard()
        self.items = []
