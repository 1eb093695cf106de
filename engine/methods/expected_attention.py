"""expected_attention: keep the tokens future queries are expected to attend, times value norm.

Paper: Devoto et al. (NVIDIA kvpress), "Expected Attention: KV Cache Compression by Estimating
Attention from Future Queries Distribution" (2025).
Rule: model the queries to come as Gaussian: mean ``mu`` and covariance ``S`` of the prompt's
queries *before RoPE* (all of them but the first ``n_sink`` positions, per query head). Future
queries sit at positions ``t .. t + n_future_positions``, so ``mu`` and ``S`` are rotated by the
average RoPE rotation ``R`` over those positions (``mu' = R mu``, ``S' = R S R^T``). The expected
unnormalised attention a key ``k`` receives is ``E[exp(q.k/sqrt d)] = exp(mu'.k/sqrt d +
k^T S' k / 2d)``; it is normalised over the head's tokens (softmax), averaged over the GQA group,
and multiplied by ``||v||`` (``use_vnorm``). The first ``n_sink`` tokens are always kept. It
compresses at the end of the prompt and needs no attention probabilities (queries are
un-rotated from the cached RoPE tables of ModelShape).

Parameters:
    budget / budget_ratio      tokens kept per (layer, kv-head); required
    n_future_positions = 512   future positions the RoPE rotation is averaged over
    n_sink = 4                 leading tokens always kept (and left out of the query statistics)
    use_covariance = True      include the covariance term
    use_vnorm = True           multiply by the value norm
    epsilon = 0.0              added to the expected attention before the value-norm rescaling
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from engine.cache.transfer import to_device
from engine.lifecycle import PrefillChunk
from engine.method_spec import MethodError
from engine.methods.registry import register
from engine.methods.scored import ScoredEviction, force_keep


@dataclass
class ExpectedAttentionParams:
    n_future_positions: int = 512
    n_sink: int = 4
    use_covariance: bool = True
    use_vnorm: bool = True
    epsilon: float = 0.0


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    h = x.shape[-1] // 2
    return torch.cat([-x[..., h:], x[..., :h]], dim=-1)


def unrope(q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Undo rotate-half RoPE: ``q`` ``[n, Hq, D]``, ``cos``/``sin`` ``[n, D]`` of its positions."""
    c, s = cos[:, None, :], sin[:, None, :]
    return (q * c - rotate_half(q) * s) / (c * c + s * s)


def mean_rotation(cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The average ``[D, D]`` RoPE rotation matrix over positions whose tables are ``[F, D]``."""
    D = cos.shape[-1]
    h = D // 2
    P = torch.zeros(D, D, device=cos.device)
    P[h:, :h] = torch.eye(h, device=cos.device)
    P[:h, h:] = -torch.eye(h, device=cos.device)
    return torch.diag(cos.float().mean(0)) + sin.float().mean(0)[:, None] * P


def rope_at(cos: torch.Tensor, sin: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of the RoPE tables ``[T, D]`` at positions ``pos`` ``[F]``, also at or past their end
    ``T`` (the tables stop at max_model_len, the future positions need not): by angle addition,
    ``p = j (T-1) + r`` rotates ``r``'s row ``j`` times by row ``T-1``. The tables hold
    ``s cos(p theta)``, ``s sin(p theta)`` with ``s`` (the attention scaling) = ``cos[0]``."""
    top = int(pos.max())  # read before the move: positions come from the host (no device sync)
    pos = pos.to(cos.device)
    last = cos.shape[0] - 1
    if last < 1 or top <= last:
        return cos[pos.clamp(max=max(last, 0))], sin[pos.clamp(max=max(last, 0))]
    s = cos[0].float()
    j, r = pos // last, pos % last
    c, sn = cos[r].float() / s, sin[r].float() / s
    cl, sl = cos[last].float() / s, sin[last].float() / s
    for step in range(top // last):
        more = (j > step)[:, None]
        c, sn = torch.where(more, c * cl - sn * sl, c), torch.where(more, sn * cl + c * sl, sn)
    return c * s, sn * s


def expected_attention_scores(
    k: torch.Tensor,
    v: torch.Tensor,
    lengths: torch.Tensor,
    mu: torch.Tensor,
    cov: torch.Tensor | None,
    n_sink: int,
    use_vnorm: bool = True,
    epsilon: float = 0.0,
) -> torch.Tensor:
    """Keys/values ``[H, T, D]``, query mean ``[Hq, D]`` and covariance ``[Hq, D, D]`` (rotated to
    the future positions) -> ``[H, T]`` scores, the first ``n_sink`` tokens forced to the top."""
    H, T, D = k.shape
    G = mu.shape[0] // H
    kf = k.float().repeat_interleave(G, 0)  # [Hq, T, D]
    logits = torch.einsum("htd,hd->ht", kf, mu.float()) / math.sqrt(D)
    if cov is not None:
        logits = logits + torch.einsum("htd,hde,hte->ht", kf, cov.float(), kf) / (2 * D)
    t = torch.arange(T, device=k.device)
    lengths = to_device(lengths, k.device)
    n = lengths.repeat_interleave(G)[:, None]
    logits = logits.masked_fill((t >= n) | (t < n_sink), float("-inf"))
    scores = torch.softmax(logits, dim=-1).nan_to_num(0.0).reshape(H, G, T).mean(1)
    if use_vnorm:
        scores = (scores + epsilon) * v.float().norm(dim=-1)
    valid = t[None, :] < lengths[:, None]
    scores = scores.masked_fill(~valid, float("-inf"))
    return force_keep(scores, valid & (t < n_sink)[None, :])


@register
class ExpectedAttention(ScoredEviction):
    name = "expected_attention"
    Params = ExpectedAttentionParams

    def __init__(self, spec, shape):
        super().__init__(spec, shape)
        if shape.rope_cos is None:
            raise MethodError("expected_attention needs the model's RoPE tables")
        if self.params.n_future_positions < 1 or self.params.n_sink < 0:
            raise MethodError("expected_attention.n_future_positions must be >= 1 and n_sink >= 0")
        self._stats: dict[tuple, list] = {}  # (seq, layer) -> [count, sum q, sum q q^T]

    def observe(self, layer: int, chunk: PrefillChunk) -> None:
        key = (chunk.seq_id, layer)
        if chunk.start == 0 or key not in self._stats:
            Hq, D = self.shape.num_heads, self.shape.head_dim
            dev = chunk.q.device
            self._stats[key] = [0, torch.zeros(Hq, D, device=dev), torch.zeros(Hq, D, D, device=dev)]
        first = max(self.params.n_sink - chunk.start, 0)
        if first >= chunk.length:
            return
        pos = torch.arange(chunk.start + first, chunk.num_tokens, device=self.shape.rope_cos.device)
        q = unrope(chunk.q[first:].float(), self.shape.rope_cos[pos], self.shape.rope_sin[pos]).to(chunk.q.device)
        st = self._stats[key]
        st[0] += q.shape[0]
        st[1] += q.sum(0)
        st[2] += torch.einsum("nhd,nhe->hde", q, q)

    def query_statistics(self, seq_id, layer: int, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Mean and covariance of the queries, rotated by the mean RoPE over the future positions."""
        n, s1, s2 = self._stats[(seq_id, layer)]
        mu = s1 / max(n, 1)
        pos = torch.arange(num_tokens, num_tokens + self.params.n_future_positions)
        R = mean_rotation(*rope_at(self.shape.rope_cos, self.shape.rope_sin, pos)).to(mu.device)
        cov = None
        if self.params.use_covariance:
            cov = s2 / max(n, 1) - mu[:, :, None] * mu[:, None, :]
            cov = R @ cov @ R.T
        return mu @ R.T, cov

    def score(self, layer: int, chunk: PrefillChunk) -> torch.Tensor:
        mu, cov = self.query_statistics(chunk.seq_id, layer, chunk.num_tokens)
        k, v, _, _ = chunk.cache.gather(chunk.seq_id, layer)
        return expected_attention_scores(
            k, v, chunk.lengths, mu, cov, self.params.n_sink, self.params.use_vnorm, self.params.epsilon
        )

    def fork_state(self, seq_id, child_id) -> None:
        for (s, layer), st in list(self._stats.items()):
            if s == seq_id:
                self._stats[(child_id, layer)] = [st[0], st[1].clone(), st[2].clone()]

    def release(self, seq_id) -> None:
        for key in [k for k in self._stats if k[0] == seq_id]:
            del self._stats[key]
