"""Host -> device copies that never make the host wait, and page arithmetic shared by the cache.

A copy from pageable host memory first waits for all work queued on the stream (a decode step in
flight, a whole prefill pass). A copy from pinned memory is queued behind that work instead. But
pinning a fresh buffer for every small tensor is no cure: torch's pinned-memory cache hands a
buffer back only once the copies that used it have run, so while the device is busy every small
copy pins new memory (``cudaHostAlloc``, slow, and serialising with the device). Small tensors are
therefore staged through one pinned ring, allocated once per device: its slabs are reused in turn,
and a slab is reused only after the copies from it have completed (they have, long since, unless the
host runs a whole ring ahead of the device).
"""

from __future__ import annotations

import threading

import torch


def ceil_div(a: torch.Tensor | int, b: int):
    return (a + b - 1) // b


class PinnedStaging:
    """A ring of pinned slabs for small host -> device copies on one device."""

    SLAB_BYTES = 1 << 20
    SLABS = 32

    def __init__(self, device: torch.device):
        self.device = device
        self.buf = torch.empty(self.SLAB_BYTES * self.SLABS, dtype=torch.uint8).pin_memory()
        self.events: list = [None] * self.SLABS
        self.slab = 0
        self.offset = 0
        self.lock = threading.Lock()

    def copy(self, t: torch.Tensor) -> torch.Tensor:
        t = t.contiguous()
        n = t.numel() * t.element_size()
        out = torch.empty(t.shape, dtype=t.dtype, device=self.device)
        if n == 0:
            return out
        with self.lock:
            if self.offset + n > self.SLAB_BYTES:  # next slab: wait for the copies that used it last
                self.slab = (self.slab + 1) % self.SLABS
                self.offset = 0
                if self.events[self.slab] is not None:
                    self.events[self.slab].synchronize()
            start = self.slab * self.SLAB_BYTES + self.offset
            self.offset += (n + 63) // 64 * 64
            staged = self.buf[start : start + n].view(t.dtype).view(t.shape)
            staged.copy_(t)
            with torch.cuda.device(self.device):
                out.copy_(staged, non_blocking=True)
                event = torch.cuda.Event()
                event.record()
            self.events[self.slab] = event
        return out


_staging: dict[torch.device, PinnedStaging] = {}


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Host -> device without making the host wait (see the module docstring). A tensor already on
    a device is moved as it is; a tensor for a CPU device stays as it is."""
    device = torch.device(device)
    if device.type != "cuda" or t.device.type != "cpu":
        return t.to(device)
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if t.numel() * t.element_size() > PinnedStaging.SLAB_BYTES:
        return t.pin_memory().to(device, non_blocking=True)
    staging = _staging.get(device)
    if staging is None:
        staging = _staging[device] = PinnedStaging(device)
    return staging.copy(t)
