"""snapkv: keep what the prompt's last queries (the observation window) attend to.

Paper: Li et al., "SnapKV: LLM Knows What You are Looking for Before Generation" (NeurIPS 2024).
Rule: at the end of the prompt take the attention probabilities of its last ``window_size``
queries over the earlier tokens, sum them over the window, smooth them with a 1-D pooling of
``kernel_size`` along the sequence (stride 1, same length), average over the query heads of each
kv-head's GQA group, and keep the ``budget - window`` best tokens of every kv-head plus the window
itself (always kept). When the prompt's last prefill chunk is shorter than the window, the window
reaches back into the chunk before it: those queries are kept from the earlier chunk and their
attention is recomputed over the cache. Optionally (``decode_interval`` > 0, as in kvpress' decoding press) the same
rule runs again every ``decode_interval`` decode steps, its window being the last
``window_size`` decoded queries, so a long answer stays within ``budget + decode_interval``.

Parameters:
    budget / budget_ratio    tokens kept per (layer, kv-head), the window included; required
    window_size = 64         observation window (kvpress' default; the paper uses 32)
    kernel_size = 5          pooling kernel (kvpress and the paper's code)
    pooling = "avgpool"      ``avgpool`` or ``maxpool`` (the paper's code offers both)
    decode_interval = 0      compress again every N decode steps (0: only at the end of a prompt)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.cache.transfer import to_device
from engine.lifecycle import ChunkInfo, DecodeBatch, KeepMask, PrefillChunk
from engine.method_spec import MethodError
from engine.methods.decode_window import DecodeWindow, window_probs
from engine.methods.registry import register
from engine.methods.scored import ScoredEviction, pool_1d, rank_protected_last, topk_per_head


@dataclass
class SnapKVParams:
    window_size: int = 64
    kernel_size: int = 5
    pooling: str = "avgpool"
    decode_interval: int = 0


def snapkv_scores(probs: torch.Tensor, lengths: torch.Tensor, kernel_size: int, pooling: str) -> torch.Tensor:
    """SnapKV's score from window probabilities ``[Hq, w, T]``: ``[H, T]``, the window (the last w
    tokens of each head) ranked above every other token, later ones higher, -inf past each head's end."""
    return scores_from_window_sums(
        probs[..., : int(lengths.max())].float().sum(1), probs.shape[1], lengths, kernel_size, pooling
    )


def scores_from_window_sums(
    summed: torch.Tensor, w: int, lengths: torch.Tensor, kernel_size: int, pooling: str
) -> torch.Tensor:
    """The same from the window's probabilities summed over its ``w`` queries, ``[Hq, T]``, rows of
    query heads grouped by kv-head (several layers stacked are several groups of heads).

    All heads at once: each head's prefix (its tokens before the window) is pooled as if on its own
    — past it the row holds the pooling's own padding (0 for avgpool, -inf for maxpool). A handful of
    kernels whatever the number of heads."""
    H = len(lengths)
    Tmax = int(lengths.max())  # host lengths: no device sync
    n = to_device(lengths, summed.device)[:, None]
    t = torch.arange(Tmax, device=summed.device)[None, :]
    prefix = t < (n - w).clamp(min=0)  # [H, Tmax]
    summed = summed[:, :Tmax].view(H, -1, Tmax)
    summed = summed.masked_fill(~prefix[:, None], float("-inf") if pooling == "maxpool" else 0.0)
    pooled = pool_1d(summed, kernel_size, pooling).mean(1).masked_fill(~prefix, float("-inf"))
    # a pooled score is at most a sum of w probabilities, <= w: the window's ramp above w + 1 outranks it
    ramp = (w + 1.0) + t / max(Tmax, 1)
    return torch.where(~prefix & (t < n), ramp, pooled)


@dataclass
class _Deferred:
    """A prompt's last chunk, recorded layer by layer during the pass and scored after it."""

    num_tokens: int
    length: int  # tokens per head, the same in every layer and head
    window: int
    protected: int
    sums: dict[int, torch.Tensor]  # layer -> window-summed probabilities [Hq, length]


@register
class SnapKV(ScoredEviction):
    name = "snapkv"
    Params = SnapKVParams

    def __init__(self, spec, shape):
        super().__init__(spec, shape)
        p = self.params
        self.decode_interval = p.decode_interval
        if p.window_size < 1 or p.kernel_size < 1 or self.decode_interval < 0:
            raise MethodError(f"{self.name}: window_size and kernel_size must be >= 1, decode_interval >= 0")
        if p.pooling not in ("avgpool", "maxpool"):
            raise MethodError(f"{self.name}.pooling must be avgpool or maxpool, not {p.pooling!r}")
        self._decode = DecodeWindow(p.window_size) if self.decode_interval else None
        self._tail: dict[tuple, tuple[torch.Tensor, int]] = {}  # (seq, layer) -> (last queries, end position)
        # prompts whose every layer is scored at once after the pass: one budget for every layer
        # (pyramidkv's per-layer budgets score layer by layer)
        self._defers = type(self).layer_budgets is ScoredEviction.layer_budgets
        self._deferred: dict = {}  # seq -> _Deferred

    def probs_window(self, chunk: ChunkInfo) -> int:
        return min(self.params.window_size, chunk.length)

    def observe(self, layer: int, chunk: PrefillChunk) -> None:
        """Keep the last ``window_size`` queries of a prompt across its chunks."""
        key, w = (chunk.seq_id, layer), self.params.window_size
        prev = self._tail.pop(key, None)
        if chunk.is_last:
            if prev is not None and prev[1] == chunk.start and chunk.length < w:
                self._tail[key] = (torch.cat([prev[0], chunk.q])[-w:], chunk.num_tokens)
            return
        q = chunk.q[-w:] if prev is None or prev[1] != chunk.start else torch.cat([prev[0], chunk.q])[-w:]
        self._tail[key] = (q.detach().clone(), chunk.num_tokens)

    def score(self, layer: int, chunk: PrefillChunk) -> torch.Tensor:
        probs = chunk.probs
        tail = self._tail.pop((chunk.seq_id, layer), None)
        if tail is not None:  # the window spans the chunk before: recompute its attention
            q, end = tail
            k, _, k_pos, _ = chunk.cache.gather(chunk.seq_id, layer)
            probs = window_probs(
                q, torch.arange(end - q.shape[0], end, device=k.device), k, k_pos, self.shape.head_dim**-0.5
            )
        return snapkv_scores(probs, chunk.lengths, self.params.kernel_size, self.params.pooling)

    # --- every layer of a prompt scored at once -----------------------------------------------------
    def after_prefill_chunk(self, layer: int, chunk: PrefillChunk):
        """A prompt's last chunk whose heads all hold the same number of tokens (the usual case) is
        recorded, its window's probabilities summed, and scored with every other layer once the
        pass is queued (``after_prefill_pass``): a few kernels per prompt instead of a few per layer.
        Other chunks take the rule layer by layer (ScoredEviction)."""
        lengths = chunk.lengths
        if not (self._defers and chunk.is_last and bool((lengths == lengths[0]).all())):
            return super().after_prefill_chunk(layer, chunk)
        self.observe(layer, chunk)
        T, budget = int(lengths[0]), self.budget_for(chunk.num_tokens)
        if T <= budget:
            return None
        rec = self._deferred.get(chunk.seq_id)
        if (chunk.seq_id, layer) in self._tail or (rec is not None and rec.length != T):
            return self.keep_by_rule(layer, chunk)  # the window spans chunks: this layer on its own
        if rec is None:
            rec = self._deferred[chunk.seq_id] = _Deferred(
                chunk.num_tokens, T, chunk.probs.shape[1], chunk.protected, {}
            )
        rec.sums[layer] = chunk.probs[..., :T].float().sum(1)
        return None

    def after_prefill_pass(self) -> KeepMask | None:
        deferred, self._deferred = self._deferred, {}
        if not deferred:
            return None
        H = self.shape.num_kv_heads
        T = max(rec.length for rec in deferred.values())
        device = next(iter(next(iter(deferred.values())).sums.values())).device
        mask = torch.ones(len(deferred), self.shape.num_layers, H, T, dtype=torch.bool, device=device)  # keep
        for b, rec in enumerate(deferred.values()):
            layers = sorted(rec.sums)
            rows = len(layers) * H
            sums = torch.cat([rec.sums[layer] for layer in layers])  # [layers * Hq, length]
            scores = scores_from_window_sums(
                sums, rec.window, torch.full((rows,), rec.length), self.params.kernel_size, self.params.pooling
            )
            best = rank_protected_last(scores, rec.protected).topk(self.budget_for(rec.num_tokens), dim=-1).indices
            kept = torch.zeros(rows, rec.length, dtype=torch.bool, device=device).scatter_(1, best, True)
            mask[b, layers, :, : rec.length] = kept.view(len(layers), H, rec.length)
        return KeepMask(list(deferred), mask)

    # --- optional decode-time compression -------------------------------------------------------
    def decode_hooks_due(self, seq_ids, lengths) -> bool:
        return self._decode is not None  # every step: it records the decode queries

    def after_decode(self, layer: int, batch: DecodeBatch):
        if self._decode is None:
            return None
        out = {}
        for i, seq_id in enumerate(batch.seq_ids):
            steps = self._decode.push(seq_id, layer, batch.q[i], batch.num_tokens[i] - 1)
            lengths = batch.lengths[i]
            budget = self.budget_for(batch.num_tokens[i])
            if steps % self.decode_interval or int(lengths.max()) <= budget:
                continue
            q, q_pos = self._decode.queries(seq_id, layer)
            k, _, k_pos, _ = batch.cache.gather(seq_id, layer)
            probs = window_probs(q, q_pos, k, k_pos, self.shape.head_dim**-0.5)
            scores = snapkv_scores(probs, lengths, self.params.kernel_size, self.params.pooling)
            out[seq_id] = topk_per_head(scores, lengths, [budget] * len(lengths))
        return out

    def release(self, seq_id) -> None:
        self._deferred.pop(seq_id, None)
        for key in [k for k in self._tail if k[0] == seq_id]:
            del self._tail[key]
        if self._decode is not None:
            self._decode.release(seq_id)

    def fork_state(self, seq_id, child_id) -> None:
        if self._decode is not None:
            self._decode.fork(seq_id, child_id)
