"""The last few decode queries of each (sequence, layer), and their attention over the cache.

Methods that compress *during* decoding every N steps (SnapKV's decode option, R-KV) score the
cache with the attention of the most recent queries. Recording a query is cheap; the attention is
recomputed in plain torch only on the steps that compress, so the backend never has to return
decode probabilities for them.
"""

from __future__ import annotations

from collections import deque
from typing import Hashable

import torch


class DecodeWindow:
    def __init__(self, size: int):
        self.size = size
        self._q: dict[tuple[Hashable, int], deque] = {}
        self._steps: dict[tuple[Hashable, int], int] = {}

    def push(self, seq_id: Hashable, layer: int, q: torch.Tensor, position: int) -> int:
        """Record one decode query ``[Hq, D]`` at its logical position; returns the steps seen."""
        key = (seq_id, layer)
        dq = self._q.setdefault(key, deque(maxlen=self.size))
        dq.append((q.detach().clone(), position))
        self._steps[key] = self._steps.get(key, 0) + 1
        return self._steps[key]

    def queries(self, seq_id: Hashable, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``[w, Hq, D]`` queries and ``[w]`` positions, oldest first."""
        items = list(self._q[(seq_id, layer)])
        return torch.stack([q for q, _ in items]), torch.tensor([p for _, p in items])

    def release(self, seq_id: Hashable) -> None:
        for key in [k for k in self._q if k[0] == seq_id]:
            del self._q[key]
            self._steps.pop(key, None)

    def fork(self, seq_id: Hashable, child_id: Hashable) -> None:
        for (s, layer), dq in list(self._q.items()):
            if s == seq_id:
                self._q[(child_id, layer)] = deque(dq, maxlen=self.size)
                self._steps[(child_id, layer)] = self._steps[(s, layer)]


def window_probs(
    q: torch.Tensor, q_pos: torch.Tensor, k: torch.Tensor, k_pos: torch.Tensor, scale: float
) -> torch.Tensor:
    """Softmax attention of queries ``[w, Hq, D]`` over one layer's cached keys ``[H, T, D]``
    (``k_pos`` ``[H, T]``, -1 past a head's end), causal by position: ``[Hq, w, T]``."""
    w, Hq, D = q.shape
    H, T, _ = k.shape
    G = Hq // H
    qh = q.to(k.device).float().permute(1, 0, 2).reshape(H, G, w, D)
    scores = torch.einsum("hgwd,htd->hgwt", qh, k.float()) * scale
    ok = (k_pos[:, None, :] >= 0) & (k_pos[:, None, :] <= q_pos.to(k_pos.device)[None, :, None])  # [H, w, T]
    scores = scores.masked_fill(~ok[:, None], float("-inf"))
    return torch.softmax(scores, dim=-1).reshape(Hq, w, T)
