"""Copies of the cold tier between the device and host memory that neither the host nor the compute stream waits on.

The recall tier (engine/recall.py) moves what a ``<method>+recall`` compaction evicts into a
ColdStore on the host (engine/cache/cold_store.py), and a recall brings cold blocks back. On CUDA
both copies run on a side stream of the device (``ColdCopier.stream``) through pinned host buffers:

* **device -> host** (``to_host``): the caller has already gathered the evicted tokens out of their
  pages into fresh device tensors on the compute stream, and a compaction reuses pages only after
  that gather (stream order). The side stream waits for the compute stream's work queued so far
  (the gather included), copies the tensors into pinned buffers and records ``done``. The
  ``HostCopy`` keeps the device tensors referenced until ``done`` has passed, so the allocator
  cannot hand their memory to the compute stream while the copy still reads it. Once ``done`` has
  passed (``ColdStore.poll``, each step), the store's writer thread (``write``) moves the staged
  values into its host arrays, a host memory copy the engine thread does not wait for either; the
  engine thread writes them itself only when it must read them first (``ColdStore.flush``: a
  recall of those blocks, a compaction, a snapshot). Dropping a copy in flight
  (``HostCopy.discard``) waits for it first.
* **host -> device** (``to_device``): the store gathers the blocks straight into pinned buffers
  (``host_buffer``); the side stream copies them into device tensors allocated on the compute
  stream, and the compute stream waits for that copy (``DeviceCopy.wait``) only where the tokens
  are used, so the copy overlaps the work queued in between (the hot tokens' gather).

Without CUDA the same calls return the tensors at once (``done`` is None): the same code path,
synchronous, with identical results. Every pinned buffer a copy holds is counted
(``HostCopy.buffers``), so a test can see that none is left behind.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Protocol

import torch


class Completion(Protocol):
    """What a copy's ``done`` is (a ``torch.cuda.Event`` on CUDA)."""

    def query(self) -> bool: ...

    def synchronize(self) -> None: ...


def nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


@dataclass
class HostCopy:
    """Tensors on their way to host memory: ``host`` (pinned on CUDA) holds them once ``done``."""

    host: list[torch.Tensor]
    device: list[torch.Tensor] = field(default_factory=list)
    """The device tensors the copy reads, kept alive until it has run."""
    done: Completion | None = None

    @property
    def ready(self) -> bool:
        return self.done is None or self.done.query()

    @property
    def buffers(self) -> int:
        """Staging buffers this copy holds (0 without CUDA: the tensors are the host's already)."""
        return len(self.host) if self.done is not None else 0

    def wait(self) -> list[torch.Tensor]:
        if self.done is not None:
            self.done.synchronize()
        self.device = []
        return self.host

    def discard(self) -> None:
        """Drop the copy (waiting for it first: its buffers must not be reused while it runs)."""
        self.wait()
        self.host = []
        self.done = None


@dataclass
class DeviceCopy:
    """Tensors on their way to the device; ``wait`` makes the compute stream wait for them."""

    device: list[torch.Tensor]
    host: list[torch.Tensor] = field(default_factory=list)
    """The pinned buffers the copy reads (torch's pinned-memory cache also holds them until it ran)."""
    done: Completion | None = None

    def wait(self) -> list[torch.Tensor]:
        if self.done is not None:
            torch.cuda.current_stream(self.device[0].device).wait_event(self.done)
        self.host = []
        return self.device


class ColdCopier:
    """The side stream of one device and the thread that writes staged copies into host arrays
    (neither without CUDA), and the copies they run."""

    _by_device: dict[torch.device, "ColdCopier"] = {}

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        cuda = self.device.type == "cuda"
        self.stream = torch.cuda.Stream(self.device) if cuda else None
        self.writer = ThreadPoolExecutor(1, thread_name_prefix="cold-writer") if cuda else None

    def write(self, fn: Callable[[], None]) -> Future | None:
        """Run ``fn`` (a host memory copy: torch releases the GIL while it runs) on the writer thread;
        without one, now (then None)."""
        if self.writer is None:
            fn()
            return None
        return self.writer.submit(fn)

    @classmethod
    def for_device(cls, device: torch.device) -> "ColdCopier":
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        if device not in cls._by_device:
            cls._by_device[device] = cls(device)
        return cls._by_device[device]

    def to_host(self, tensors: list[torch.Tensor]) -> HostCopy:
        """Start copying ``tensors`` (on this device) to host memory."""
        if self.stream is None:
            return HostCopy(host=[t.to("cpu") for t in tensors])
        self.stream.wait_stream(torch.cuda.current_stream(self.device))  # the gathers that made them
        with torch.cuda.stream(self.stream):
            host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
            for h, t in zip(host, tensors):
                h.copy_(t, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.stream)
        return HostCopy(host=host, device=list(tensors), done=done)

    def host_buffer(self, shape, dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised host tensor that ``to_device`` copies from without a staging copy."""
        return torch.empty(shape, dtype=dtype, pin_memory=self.stream is not None)

    def to_device(self, tensors: list[torch.Tensor]) -> DeviceCopy:
        """Start copying host ``tensors`` (``host_buffer``s) to this device."""
        if self.stream is None:
            return DeviceCopy(device=[t.to(self.device) for t in tensors])
        # allocated on the compute stream, which uses and frees them after ``wait``; the side stream
        # writes them only after the compute stream's earlier work (a previous owner's) has run
        out = [torch.empty(t.shape, dtype=t.dtype, device=self.device) for t in tensors]
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            for o, t in zip(out, tensors):
                o.copy_(t, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.stream)
        return DeviceCopy(device=out, host=list(tensors), done=done)
