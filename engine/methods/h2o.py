"""h2o: heavy hitters (the most attention received, accumulated) plus a recent window.

Paper: Zhang et al., "H2O: Heavy-Hitter Oracle for Efficient Generative Inference of Large
Language Models" (NeurIPS 2023).
Rule: every kv-head accumulates, for each token it holds, the attention probability that every
query since the token arrived gave it (summed over the query heads of the GQA group): all the
prompt's queries, then each decoded token's. A head keeps the ``recent`` most recent tokens
(``recent = round(recent_ratio * budget)``) and the ``budget - recent`` other tokens with the
largest accumulated attention (the heavy hitters). It compresses at the end of the prompt and
then at every decode step, dropping the lowest-scored non-recent token; accumulated scores move
with the tokens that stay.

Parameters:
    budget / budget_ratio   tokens kept per (layer, kv-head), heavy + recent; required
    recent_ratio = 0.5      fraction of the budget kept as the recent window (the paper splits
                            its cache half heavy hitters, half recent tokens)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.cache.transfer import to_device
from engine.lifecycle import ChunkInfo, DecodeBatch, PrefillChunk
from engine.method_spec import MethodError
from engine.methods.registry import register
from engine.methods.scored import ScoredEviction, force_keep, topk_per_head


@dataclass
class H2OParams:
    recent_ratio: float = 0.5


def accumulate(acc: torch.Tensor | None, probs: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Add probabilities ``[Hq, n, T]`` (summed over the n queries and each GQA group) to the
    accumulated ``[H, T_old]`` scores; returns ``[H, T]``, T = the longest head."""
    H = len(lengths)
    T = int(lengths.max())
    add = probs[..., :T].float().sum(1).reshape(H, -1, T).sum(1)
    if acc is None:
        return add
    return F.pad(acc, (0, T - acc.shape[-1])) + add


def h2o_scores(acc: torch.Tensor, lengths: torch.Tensor, recent: int) -> torch.Tensor:
    """Accumulated attention with each head's last ``recent`` tokens forced to the top."""
    T = acc.shape[-1]
    t = torch.arange(T, device=acc.device)
    n = to_device(lengths, acc.device)[:, None]
    return force_keep(acc.masked_fill(t >= n, float("-inf")), (t >= n - recent) & (t < n))


@register
class H2O(ScoredEviction):
    name = "h2o"
    Params = H2OParams
    needs_decode_probs = True

    def __init__(self, spec, shape):
        super().__init__(spec, shape)
        if not 0 <= self.params.recent_ratio <= 1:
            raise MethodError(f"h2o.recent_ratio must be in [0, 1], not {self.params.recent_ratio}")
        self._acc: dict[tuple, torch.Tensor] = {}

    def _recent(self, budget: int) -> int:
        return round(self.params.recent_ratio * budget)

    # prefill: every query of every chunk adds to the scores
    def prefill_probs_window(self, chunk: ChunkInfo) -> int:
        return chunk.length

    def observe(self, layer: int, chunk: PrefillChunk) -> None:
        key = (chunk.seq_id, layer)
        acc = None if chunk.start == 0 else self._acc.get(key)
        self._acc[key] = accumulate(acc, chunk.probs, chunk.lengths)

    def score(self, layer: int, chunk: PrefillChunk) -> torch.Tensor:
        return h2o_scores(
            self._acc[(chunk.seq_id, layer)], chunk.lengths, self._recent(self.budget_for(chunk.num_tokens))
        )

    def on_kept(self, layer: int, seq_id, keep) -> None:
        acc = self._acc[(seq_id, layer)]
        # keep may be on the device (topk_per_head) or the host: gather on the device without a sync
        heads = [to_device(torch.as_tensor(k, dtype=torch.int64).reshape(-1), acc.device) for k in keep]
        counts = to_device(torch.tensor([k.numel() for k in heads]), acc.device)
        idx = torch.nn.utils.rnn.pad_sequence(heads, batch_first=True)  # [H, width], 0 past a head's count
        pad = torch.arange(idx.shape[1], device=acc.device)[None, :] >= counts[:, None]
        new = torch.gather(acc, 1, idx).masked_fill(pad, 0.0)
        self._acc[(seq_id, layer)] = new

    # decode: each step's attention adds to the scores; past the budget the lowest goes
    def decode_hooks_due(self, seq_ids, lengths) -> bool:
        return True

    def after_decode(self, layer: int, batch: DecodeBatch):
        out = {}
        for i, seq_id in enumerate(batch.seq_ids):
            lengths = batch.lengths[i]
            key = (seq_id, layer)
            self._acc[key] = accumulate(self._acc.get(key), batch.probs[i][:, None], lengths)
            budget = self.budget_for(batch.num_tokens[i])
            if int(lengths.max()) > budget:
                keep = topk_per_head(
                    h2o_scores(self._acc[key], lengths, self._recent(budget)), lengths, [budget] * len(lengths)
                )
                self.on_kept(layer, seq_id, keep)
                out[seq_id] = keep
        return out

    def state_dict(self, seq_id):
        """The accumulated scores, one ``[H, T]`` tensor per layer (``acc.<layer>``)."""
        return {f"acc.{layer}": acc.cpu() for (s, layer), acc in self._acc.items() if s == seq_id}

    def load_state_dict(self, seq_id, state) -> None:
        for name, acc in state.items():
            if name.startswith("acc."):
                self._acc[(seq_id, int(name[4:]))] = acc.float()

    def fork_state(self, seq_id, child_id) -> None:
        for (s, layer), acc in list(self._acc.items()):
            if s == seq_id:
                self._acc[(child_id, layer)] = acc.clone()

    def release(self, seq_id) -> None:
        for key in [k for k in self._acc if k[0] == seq_id]:
            del self._acc[key]
