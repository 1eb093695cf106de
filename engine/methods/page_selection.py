"""Page-level key summaries (offload) and top-k page selection (quest, offload).

``PageSummaries`` keeps, per (sequence, layer), one vector per (kv-head, page) that reduces the
page's keys element-wise (``amin``, ``amax`` or ``sum``). It is updated as pages fill: each decode
step folds the step's key into its page; after a prefill chunk, or when what it covers no longer
matches the cache (a session resumed from a snapshot, a prefix pruned), it is rebuilt from the
cache itself, so it is derived state and never needs to be snapshotted.

``select_pages`` turns per-page scores into the page lists attention reads: the first ``n_sink``
and last ``n_recent`` pages of every head always, plus the best-scoring others up to ``k`` pages;
it takes a whole decode batch at once. (Quest keeps its bounds by physical page instead:
``page_bounds.PageBounds``.)
"""

from __future__ import annotations

from typing import Hashable

import torch

_FILL = {"amin": float("inf"), "amax": float("-inf"), "sum": 0.0}


class PageSummaries:
    def __init__(self, reductions: tuple[str, ...], page_size: int):
        unknown = set(reductions) - set(_FILL)
        if unknown:
            raise ValueError(f"unknown page reductions {sorted(unknown)}")
        self.reductions = reductions
        self.page_size = page_size
        self._state: dict[Hashable, dict[int, dict]] = {}

    def release(self, seq_id: Hashable) -> None:
        self._state.pop(seq_id, None)

    def fork(self, seq_id: Hashable, child_id: Hashable) -> None:
        if seq_id in self._state:
            self._state[child_id] = {
                layer: {"covered": e["covered"].clone(), **{r: e[r].clone() for r in self.reductions}}
                for layer, e in self._state[seq_id].items()
            }

    def update(self, seq_id: Hashable, layer: int, lengths: torch.Tensor, new_k: torch.Tensor | None, cache) -> dict:
        """Summaries of every page of one layer once the cache holds ``lengths`` ``[H]`` (host)
        tokens per head, the last ``new_k.shape[0]`` of them being ``new_k`` ``[n, H, D]``.
        Returns ``{reduction: [H, num_pages, D]}`` (pages past a head's end hold the fill value)."""
        lengths = lengths.to(torch.int64).cpu()
        P = self.page_size
        num_pages = int((int(lengths.max()) + P - 1) // P)
        layers = self._state.setdefault(seq_id, {})
        entry = layers.get(layer)
        n = 0 if new_k is None else new_k.shape[0]
        if entry is None or n != 1 or not bool((entry["covered"] == lengths - 1).all()):
            # a prefill chunk, a first sight or a cache that changed under us: from the cache itself
            entry = layers[layer] = self._rebuild(seq_id, layer, cache)
        else:  # a decode step: fold the new key into its page (one page per head, no repeats)
            self._grow(entry, num_pages)
            H = lengths.numel()
            dev = new_k.device
            heads = torch.arange(H, device=dev)
            page = (entry["covered"] // P).to(dev)
            key = new_k[0].float()
            for r in self.reductions:
                cur = entry[r][heads, page]
                entry[r][heads, page] = (
                    torch.maximum(cur, key) if r == "amax" else torch.minimum(cur, key) if r == "amin" else cur + key
                )
            entry["covered"] = lengths.clone()
        return {r: entry[r][:, :num_pages] for r in self.reductions}

    def _grow(self, entry: dict, num_pages: int) -> None:
        first = entry[self.reductions[0]]
        H, cap, D = first.shape
        if num_pages <= cap:
            return
        new_cap = max(num_pages, 2 * cap)
        for r in self.reductions:
            buf = torch.full((H, new_cap, D), _FILL[r], dtype=torch.float32, device=first.device)
            buf[:, :cap] = entry[r]
            entry[r] = buf

    def _rebuild(self, seq_id: Hashable, layer: int, cache) -> dict:
        k, _, _, lengths = cache.gather(seq_id, layer)  # [H, T, D]
        H, T, D = k.shape
        P = self.page_size
        num_pages = (T + P - 1) // P
        cap = max(num_pages, 4)
        k = torch.nn.functional.pad(k.float(), (0, 0, 0, cap * P - T))
        valid = (torch.arange(cap * P, device=k.device)[None, :] < lengths.to(k.device)[:, None])[..., None]
        entry = {"covered": lengths.cpu().to(torch.int64).clone()}
        for r in self.reductions:
            filled = torch.where(valid, k, torch.tensor(_FILL[r], device=k.device)).view(H, cap, P, D)
            entry[r] = {"amin": lambda x: x.amin(2), "amax": lambda x: x.amax(2), "sum": lambda x: x.sum(2)}[r](filled)
        return entry


def page_counts(lengths: torch.Tensor, num_pages: int, page_size: int) -> torch.Tensor:
    """``[H, num_pages]`` tokens in each page of each head (0 past a head's end)."""
    start = torch.arange(num_pages, device=lengths.device)[None, :] * page_size
    return (lengths.to(torch.int64)[:, None] - start).clamp(0, page_size)


def select_pages(
    scores: torch.Tensor, lengths: torch.Tensor, page_size: int, k, n_sink: int, n_recent: int
) -> torch.Tensor:
    """Page lists ``[..., H, min(max k, num_pages)]`` (-1 = unused) from scores ``[..., H, num_pages]``
    and lengths ``[..., H]`` (any leading batch dims): every head's first ``n_sink`` and last
    ``n_recent`` pages, then its best-scoring pages up to ``k`` pages in all. ``k`` is an int or a
    ``[...]`` tensor (one per row of the batch). A head with at most ``k`` pages reads all of them.
    Batched and free of host syncs."""
    NP = scores.shape[-1]
    dev = scores.device
    pages_of = (lengths.to(dev).to(torch.int64) + page_size - 1) // page_size  # [..., H]
    p = torch.arange(NP, device=dev)
    must = (p < n_sink) | (p >= pages_of[..., None] - n_recent)
    inside = p < pages_of[..., None]
    s = torch.where(must, float("inf"), torch.nan_to_num(scores.float(), nan=float("-inf")))
    s = torch.where(inside, s, float("-inf"))  # Python scalars: no host-to-device copies
    per_row = isinstance(k, torch.Tensor)
    width = min(int(k.max()) if per_row else k, NP)
    top = torch.topk(s, width, dim=-1)
    keep = top.values > float("-inf")
    if per_row:  # rows with a smaller k drop their lowest-ranked extras
        keep &= torch.arange(width, device=dev) < k.to(dev)[..., None, None]
    chosen = torch.where(keep, top.indices, NP)
    chosen = torch.sort(chosen, dim=-1).values  # in page order (a covering list reads like dense), -1 last
    return torch.where(chosen < NP, chosen, -1)
