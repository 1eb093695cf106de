"""rkv: compress long decoded outputs by importance minus redundancy, every few steps.

Paper: Cai et al., "R-KV: Redundancy-aware KV Cache Compression for Reasoning Models" (2025).
Rule: during decoding, once a head holds more than ``budget`` tokens and ``interval`` decode steps
have passed since the last compression, score its tokens outside the observation window (the last
``window_size`` decoded tokens, always kept):
  importance  = attention of the last ``window_size`` decode queries, averaged over them, max over
                the GQA group, then max-pooled along the sequence (``kernel_size``);
  redundancy  = for each key, its mean cosine similarity to the other keys of the head, turned into
                a distribution by a softmax over the tokens;
  score       = lambda * importance - (1 - lambda) * redundancy,
and keep the ``budget`` best (window included). The prompt is not compressed at prefill (R-KV
targets long reasoning outputs); it competes for the budget once decoding compresses.

Parameters:
    budget / budget_ratio   tokens kept per (layer, kv-head) after a compression; required
    interval = 128          decode steps between compressions (the paper's buffer)
    window_size = 8         observation window of recent decode queries (always kept)
    kernel_size = 7         max-pooling kernel of the importance
    lam = 0.1               weight of importance against redundancy (the paper's lambda)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.lifecycle import DecodeBatch, SparseMethod
from engine.method_spec import MethodError
from engine.methods.decode_window import DecodeWindow, window_probs
from engine.methods.registry import register
from engine.methods.scored import force_keep, pool_1d, topk_per_head


@dataclass
class RKVParams:
    interval: int = 128
    window_size: int = 8
    kernel_size: int = 7
    lam: float = 0.1


def rkv_scores(
    probs: torch.Tensor, k: torch.Tensor, lengths: torch.Tensor, kernel_size: int, lam: float
) -> torch.Tensor:
    """Window probabilities ``[Hq, w, T]`` and keys ``[H, T, D]`` -> ``[H, T]`` scores, the window
    (each head's last w tokens) forced to the top."""
    Hq, w, _ = probs.shape
    H, T, _ = k.shape
    G = Hq // H
    out = torch.full((H, T), float("-inf"), device=k.device)
    window = torch.zeros(H, T, dtype=torch.bool, device=k.device)
    for h in range(H):
        n = int(lengths[h])
        m = max(n - w, 0)
        window[h, m:n] = True
        if not m:
            continue
        imp = probs[h * G : (h + 1) * G, :, :m].float().mean(1).max(0).values
        imp = pool_1d(imp, kernel_size, "maxpool")
        unit = F.normalize(k[h, :m].float(), dim=-1)
        sim = unit @ unit.T
        sim.fill_diagonal_(0.0)
        red = torch.softmax(sim.mean(-1), dim=-1)
        out[h, :m] = lam * imp - (1 - lam) * red
    return force_keep(out, window)


@register
class RKV(SparseMethod):
    name = "rkv"
    Params = RKVParams
    needs_budget = True
    holds_budget = True

    def __init__(self, spec, shape):
        super().__init__(spec, shape)
        p = self.params
        if p.interval < 1 or p.window_size < 1 or p.kernel_size < 1 or not 0 <= p.lam <= 1:
            raise MethodError("rkv: interval, window_size, kernel_size must be >= 1 and lam in [0, 1]")
        self._window = DecodeWindow(p.window_size)

    def kept_slack(self) -> int:
        return self.params.interval

    def after_decode(self, layer: int, batch: DecodeBatch):
        out = {}
        for i, seq_id in enumerate(batch.seq_ids):
            steps = self._window.push(seq_id, layer, batch.q[i], batch.num_tokens[i] - 1)
            lengths = batch.lengths[i]
            budget = self.budget_for(batch.num_tokens[i])
            if steps % self.params.interval or int(lengths.max()) <= budget:
                continue
            q, q_pos = self._window.queries(seq_id, layer)
            k, _, k_pos, _ = batch.cache.gather(seq_id, layer)
            probs = window_probs(q, q_pos, k, k_pos, self.shape.head_dim**-0.5)
            scores = rkv_scores(probs, k, lengths, self.params.kernel_size, self.params.lam)
            out[seq_id] = topk_per_head(scores, lengths, [budget] * len(lengths))
        return out

    def fork_state(self, seq_id, child_id) -> None:
        self._window.fork(seq_id, child_id)

    def release(self, seq_id) -> None:
        self._window.release(seq_id)
