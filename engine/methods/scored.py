"""Shared machinery of the eviction methods that score tokens: compress at the end of a prompt.

A :class:`ScoredEviction` method scores every physical token of each kv-head of a layer once the
turn's input is in (the last prefill chunk), and keeps the top of each head — everything else is
freed by the cache manager. Subclasses supply the rule:

* ``observe(layer, chunk)``   called for every prefill chunk (accumulate statistics); optional
* ``probs_window(chunk)``     queries of the last chunk whose attention probabilities ``score``
                              reads (0: none, and the backend computes none)
* ``score(layer, chunk)``     ``[H, T]`` float scores, T = the longest head; higher is kept
* ``layer_budgets(...)``      tokens per head for one layer (default: the spec's budget for all)
* ``select(...)``             keep-indices from scores (default: a top-k within each head)

The selection helpers are plain functions so the tests can check them against the papers' rules.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod

import torch
import torch.nn.functional as F

from engine.cache.transfer import to_device
from engine.distributed import group
from engine.lifecycle import ChunkInfo, PrefillChunk, SparseMethod


def mask_past_lengths(scores: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """``scores`` ``[H, T]`` with every position past a head's length set to -inf."""
    T = scores.shape[-1]
    t = torch.arange(T, device=scores.device)
    return scores.masked_fill(t[None, :] >= to_device(lengths, scores.device)[:, None], float("-inf"))


def topk_per_head(scores: torch.Tensor, lengths: torch.Tensor, budgets) -> "torch.Tensor | list[torch.Tensor]":
    """Sorted indices of the ``budgets[h]`` best tokens of each head (all of a head within budget).

    Heads of the same length and budget (usually all of a layer) share one top-k over
    ``scores[heads, :length]`` — per row exactly the call a head alone would make, so ties fall the
    same way. Returns one index tensor per head (the rows of one ``[H, k]`` tensor when every head
    keeps the same count), on the scores' device: no host sync."""
    n = [int(x) for x in lengths.tolist()]  # lengths live on the host: no device sync
    b = [int(x) for x in budgets]
    out = [torch.arange(x) for x in n]
    groups: dict[tuple[int, int], list[int]] = {}
    for h in range(len(n)):
        if n[h] > b[h]:
            groups.setdefault((n[h], b[h]), []).append(h)
    if not groups:
        return out
    H, dev = len(n), scores.device
    if len(groups) == 1 and len(next(iter(groups.values()))) == H:  # the usual case: one call, no gather
        ((length, k),) = groups
        return scores[:, :length].float().topk(k, dim=-1).indices.sort(dim=-1).values  # [H, k]: a row per head
    else:
        idx = torch.full((H, max(k for _, k in groups)), scores.shape[-1], dtype=torch.int64, device=dev)
        for (length, k), heads in groups.items():
            rows = to_device(torch.tensor(heads), dev)
            idx[rows, :k] = scores.index_select(0, rows)[:, :length].float().topk(k, dim=-1).indices
    idx = idx.sort(dim=-1).values
    for (_, k), heads in groups.items():
        for h in heads:
            out[h] = idx[h, :k]
    return out


def topk_across_heads(scores: torch.Tensor, lengths: torch.Tensor, total: int, floor: int) -> list[torch.Tensor]:
    """Ada-KV's selection: each head first keeps its own ``floor`` best tokens, then one top-k over
    the remaining scores of all heads fills the layer's ``total``; heads end up with different counts.
    One device -> host copy (the keep mask); ``lengths`` are read on the host."""
    H, T = scores.shape
    if int(lengths.sum()) <= total:
        return [torch.arange(int(n)) for n in lengths]
    scores = mask_past_lengths(scores.float(), lengths)
    if floor > 0:
        f = min(floor, T)
        safe = scores.topk(f, dim=-1).indices
        ok = torch.gather(scores, 1, safe) > float("-inf")
        scores = scores.scatter(1, safe, torch.where(ok, float("inf"), float("-inf")))
    flat = scores.reshape(-1).topk(total).indices
    keep = torch.zeros(H * T, dtype=torch.bool, device=scores.device)
    keep[flat] = True
    keep = keep.view(H, T).cpu()
    return [keep[h].nonzero().flatten() for h in range(H)]


def pool_1d(x: torch.Tensor, kernel: int, pooling: str) -> torch.Tensor:
    """1-D pooling along the last axis, stride 1, same length (SnapKV's smoothing of scores)."""
    if kernel <= 1 or x.shape[-1] == 0:
        return x
    shape = x.shape
    x = x.reshape(-1, 1, shape[-1])
    if pooling == "maxpool":
        x = F.max_pool1d(x, kernel, stride=1, padding=kernel // 2)
    else:
        x = F.avg_pool1d(x, kernel, stride=1, padding=kernel // 2)
    return x[..., : shape[-1]].reshape(shape)


def group_mean(x: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """``[Hq, ...]`` -> ``[H, ...]``: mean over each kv-head's group of query heads (GQA)."""
    return x.reshape(num_kv_heads, -1, *x.shape[1:]).mean(1)


class ScoredEviction(SparseMethod, ABC):
    """Base of the prefill-end eviction methods: score each head's tokens, keep the top."""

    needs_budget = True
    holds_budget = True
    spans_heads = False
    """The rule reads every head of a layer (a mean or a top-k across heads). Under tensor
    parallelism a layer's heads are split over ranks, so such a method runs a collective, and the
    decision whether a layer is compressed at all is taken over every rank's heads."""

    @property
    def rule(self) -> "ScoredEviction":
        """Whose rule scores the tokens (``observe``, ``probs_window``, ``score``, ``on_kept``) and
        holds the per-sequence state: the method itself, or the scorer a wrapper holds (adakv)."""
        return self

    # --- the rule (subclasses) ---------------------------------------------------------------
    def observe(self, layer: int, chunk: PrefillChunk) -> None:
        pass

    def probs_window(self, chunk: ChunkInfo) -> int:
        return 0

    @abstractmethod
    def score(self, layer: int, chunk: PrefillChunk) -> torch.Tensor:
        """The method's rule (every subclass defines it): ``[H, T]`` scores, higher is kept."""

    def layer_budgets(self, layer: int, lengths: torch.Tensor, num_tokens: int) -> list[int]:
        return [self.budget_for(num_tokens)] * len(lengths)

    def select(self, layer: int, scores: torch.Tensor, lengths: torch.Tensor, num_tokens: int):
        return topk_per_head(scores, lengths, self.layer_budgets(layer, lengths, num_tokens))

    def on_kept(self, layer: int, seq_id, keep: list[torch.Tensor]) -> None:
        """The tokens ``keep[h]`` stay (methods with per-token state reindex it)."""

    # --- hooks ---------------------------------------------------------------------------------
    def prefill_probs_window(self, chunk: ChunkInfo) -> int:
        return self.rule.probs_window(chunk) if chunk.is_last else 0

    def after_prefill_chunk(self, layer: int, chunk: PrefillChunk):
        rule = self.rule
        rule.observe(layer, chunk)
        if not chunk.is_last:
            return None
        budgets = self.layer_budgets(layer, chunk.lengths, chunk.num_tokens)
        due = any(int(n) > b for n, b in zip(chunk.lengths, budgets))
        if self.spans_heads:  # every rank scores (a collective) or none does
            due = group.any_rank(due)
        if not due:
            return None
        return self.keep_by_rule(layer, chunk)

    def keep_by_rule(self, layer: int, chunk: PrefillChunk):
        """The rule applied to one layer of a prompt's last chunk: score, a protected prefix ranked
        last, the budget's best kept (the rule's per-token state follows)."""
        keep = self.select(
            layer, rank_protected_last(self.rule.score(layer, chunk), chunk.protected), chunk.lengths, chunk.num_tokens
        )
        self.rule.on_kept(layer, chunk.seq_id, keep)
        return keep

    # --- per-sequence state: the rule's (a wrapper's scorer keeps it) ----------------------------
    def on_admit(self, seq) -> None:
        if self.rule is not self:
            self.rule.on_admit(seq)

    def state_dict(self, seq_id):
        return self.rule.state_dict(seq_id) if self.rule is not self else super().state_dict(seq_id)

    def load_state_dict(self, seq_id, state) -> None:
        if self.rule is not self:
            self.rule.load_state_dict(seq_id, state)
        else:
            super().load_state_dict(seq_id, state)

    def fork_state(self, seq_id, child_id) -> None:
        if self.rule is not self:
            self.rule.fork_state(seq_id, child_id)

    def release(self, seq_id) -> None:
        if self.rule is not self:
            self.rule.release(seq_id)


def rank_protected_last(scores: torch.Tensor, protected: int) -> torch.Tensor:
    """``scores`` ``[H, T]`` with the first ``protected`` tokens of every head ranked below all
    others. The cache keeps them whatever is chosen (a prefix whose pages other sequences share),
    so the budget goes to the other tokens and every head ends with ``protected + budget``: heads
    of one length, which attend and score in one batch."""
    if protected <= 0:
        return scores
    return scores.masked_fill(torch.arange(scores.shape[-1], device=scores.device) < protected, float("-inf"))


def force_keep(scores: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """``scores`` with the positions of the bool mask ``keep`` raised above every other score
    (later positions highest, so a budget smaller than the forced set keeps the most recent)."""
    if scores.numel() == 0:
        return scores
    finite = torch.isfinite(scores)  # top and span stay on the device: no host read
    hi = scores.masked_fill(~finite, float("-inf")).amax()
    lo = scores.masked_fill(~finite, float("inf")).amin()
    some = finite.any()
    top = torch.where(some, hi, 0.0)
    span = torch.where(some, hi - lo, 1.0)
    ramp = torch.linspace(1.0, 2.0, scores.shape[-1], device=scores.device)
    return torch.where(keep, top + (span + 1.0) * ramp, scores)


def split_evenly(total: int, weights: list[float]) -> list[int]:
    """Integers proportional to ``weights`` that add up to ``total`` exactly (largest remainder)."""
    s = sum(weights)
    raw = [total * w / s for w in weights] if s > 0 else [total / len(weights)] * len(weights)
    base = [math.floor(r) for r in raw]
    rest = total - sum(base)
    order = sorted(range(len(raw)), key=lambda i: raw[i] - base[i], reverse=True)
    for i in order[:rest]:
        base[i] += 1
    return base
