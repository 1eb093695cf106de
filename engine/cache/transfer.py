"""Host -> device copies that never make the host wait, and page arithmetic shared by the cache."""

from __future__ import annotations

import torch


def ceil_div(a: torch.Tensor | int, b: int):
    return (a + b - 1) // b


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Host -> device without making the host wait: a copy from pageable memory would first wait
    for all work queued on the stream (the decode step in flight); a pinned one is queued behind it.
    A tensor already on a device is moved as it is."""
    device = torch.device(device)
    if device.type != "cuda" or t.device.type != "cpu":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)
