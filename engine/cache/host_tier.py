"""HostTier: pages of KV in host memory, for methods that offload cold KV (InfLLM-style offload).

Same page shape as the device pool (K, V ``[page_size, head_dim]`` and positions per page), its own
free list and counters. On a machine with CUDA the buffers are pinned, so host <-> device copies
run as DMA; on a CPU-only machine they are ordinary tensors but go through the same code and the
same accounting. The tier grows on demand (doubling), so it needs no size setting; it never
shrinks while the engine runs.
"""

from __future__ import annotations

import torch


class HostTier:
    def __init__(self, page_size: int, head_dim: int, dtype: torch.dtype, initial_pages: int = 64):
        self.page_size = page_size
        self.head_dim = head_dim
        self.dtype = dtype
        self.pinned = torch.cuda.is_available()
        self.capacity = 0
        self.k = self.v = self.pos = None
        self._free: list[int] = []
        self.fetches = 0
        """Pages copied host -> device (a counter for tests and metrics)."""
        self.offloads = 0
        """Pages copied device -> host."""
        self._grow(initial_pages)

    def _buffer(self, *shape, dtype) -> torch.Tensor:
        with torch.inference_mode(False):  # created mid-step; written in and out of inference mode
            return torch.zeros(*shape, dtype=dtype, pin_memory=self.pinned)

    def _grow(self, capacity: int) -> None:
        P, D = self.page_size, self.head_dim
        k, v, pos = (
            self._buffer(capacity, P, D, dtype=self.dtype),
            self._buffer(capacity, P, D, dtype=self.dtype),
            self._buffer(capacity, P, dtype=torch.int32),
        )
        if self.capacity:
            with torch.inference_mode(False):
                k[: self.capacity], v[: self.capacity], pos[: self.capacity] = self.k, self.v, self.pos
        self._free.extend(range(capacity - 1, self.capacity - 1, -1))
        self.k, self.v, self.pos, self.capacity = k, v, pos, capacity

    @property
    def num_used(self) -> int:
        return self.capacity - len(self._free)

    def alloc(self, n: int) -> torch.Tensor:
        if n > len(self._free):
            self._grow(max(2 * self.capacity, self.num_used + n))
        ids = [self._free.pop() for _ in range(n)]
        return torch.tensor(ids, dtype=torch.int64)

    def free(self, ids: torch.Tensor) -> None:
        self._free.extend(ids.reshape(-1).tolist())

    def write(self, ids: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor) -> None:
        """Store whole pages (device tensors ``[n, P, D]``) at host pages ``ids``."""
        self.k[ids] = k.to("cpu", self.dtype)
        self.v[ids] = v.to("cpu", self.dtype)
        self.pos[ids] = pos.to("cpu", torch.int32)
        self.offloads += ids.numel()

    def read(self, ids: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Pages ``ids`` copied to ``device`` (pinned staging, non-blocking on CUDA)."""
        self.fetches += ids.numel()
        out = []
        for buf in (self.k, self.v, self.pos):
            page = buf[ids]
            if device.type == "cuda":
                out.append(page.pin_memory().to(device, non_blocking=True))
            else:
                out.append(page.to(device))
        return out[0], out[1], out[2]
