"""keydiff: keep the most distinctive keys — those least similar to the head's mean key.

Paper: Park et al., "KeyDiff: Key Similarity-Based KV Cache Eviction for Long-Context LLM
Inference in Resource-Constrained Environments" (2025).
Rule: for each kv-head, normalise its cached keys (after RoPE, as cached) to unit length, take
their mean as the anchor, and score every key by its negative cosine similarity to the anchor;
keep the ``budget`` highest scores. It needs no attention probabilities (works with any
attention kernel) and compresses at the end of the prompt.

Parameters:
    budget / budget_ratio   tokens kept per (layer, kv-head); required
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.cache.transfer import to_device
from engine.lifecycle import PrefillChunk
from engine.methods.registry import register
from engine.methods.scored import ScoredEviction


def keydiff_scores(k: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Keys ``[H, T, D]`` (padded past each head's length) -> ``[H, T]`` = -cos(key, mean unit key)."""
    H, T, _ = k.shape
    valid = (torch.arange(T, device=k.device)[None, :] < to_device(lengths, k.device)[:, None]).float()
    unit = F.normalize(k.float(), dim=-1) * valid[..., None]
    anchor = unit.sum(1, keepdim=True) / valid.sum(1).clamp(min=1)[:, None, None]
    return -F.cosine_similarity(k.float(), anchor, dim=-1)


@register
class KeyDiff(ScoredEviction):
    name = "keydiff"

    def score(self, layer: int, chunk: PrefillChunk) -> torch.Tensor:
        k, _, _, _ = chunk.cache.gather(chunk.seq_id, layer)
        return keydiff_scores(k, chunk.lengths)
