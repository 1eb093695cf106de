"""streaming_llm: attention sinks plus a sliding window of recent tokens.

Paper: Xiao et al., "Efficient Streaming Language Models with Attention Sinks" (ICLR 2024).
Rule: keep the first ``n_sink`` tokens (the attention sinks) and the most recent
``budget - n_sink`` tokens of every (layer, kv-head); evict the rest. It evicts after every prefill
chunk, so a long prompt never holds more than ``budget`` + one chunk, and while decoding once a
head grows past its budget by more than ``slack`` tokens.

Parameters:
    budget / budget_ratio   tokens kept per head (sink + window); required
    n_sink = 4              attention-sink tokens kept at the start (the paper uses 4)
    slack = 64              decoding lets a head grow this many tokens past the budget before it is
                            cut back to the budget. The paper's rule is ``slack = 0``: an eviction
                            after every decode step. The default holds up to 64 more tokens per head
                            than the paper (the most recent ones, so attention sees a superset of
                            the paper's window), and evicts once every ``slack + n_sink`` steps
                            instead of every step; the steps in between replay the decode CUDA
                            graph. When one sequence of a batch is due, every sequence past its
                            budget is cut with it (one compaction for the batch, and the batch stays
                            in step).

A shared prefix the session is protected by (a system prompt stored once for many sessions) is
kept in addition to the budget and does not count against it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.cache.compaction import COMPACTION_CHUNK_BYTES
from engine.cache.transfer import to_device
from engine.lifecycle import KeepMask, PrefillChunk, SparseMethod
from engine.method_spec import MethodError
from engine.methods.registry import register


@dataclass
class StreamingLLMParams:
    n_sink: int = 4
    slack: int = 64


@register
class StreamingLLM(SparseMethod):
    name = "streaming_llm"
    Params = StreamingLLMParams
    needs_budget = True
    holds_budget = True

    def __init__(self, spec, shape):
        super().__init__(spec, shape)
        if self.params.n_sink < 0 or self.params.slack < 0:
            raise MethodError("streaming_llm.n_sink and streaming_llm.slack must be >= 0")
        if spec.budget is not None and spec.budget <= self.params.n_sink:
            raise MethodError(f"streaming_llm budget ({spec.budget}) must exceed n_sink ({self.params.n_sink})")

    def kept_slack(self) -> int:
        return self.params.slack

    def after_prefill_chunk(self, layer: int, chunk: PrefillChunk):
        lengths = chunk.lengths
        budget = self.budget_for(chunk.num_tokens)
        if int(lengths.max()) <= budget:
            return None
        if bool((lengths == lengths[0]).all()):  # the usual case: every head holds the same tokens
            return recent_and_sink(int(lengths[0]), self.params.n_sink, budget).expand(len(lengths), -1)
        return [recent_and_sink(int(n), self.params.n_sink, budget) for n in lengths]

    def after_decode_step(self, seqs, lengths: torch.Tensor) -> KeepMask | None:
        budgets = torch.tensor([self.budget_for(s.num_tokens) for s in seqs])
        limit = budgets + torch.tensor([s.protected_len for s in seqs])
        longest = lengths.amax(dim=(1, 2))
        if not bool((longest > limit + self.params.slack).any()):
            return None
        due = (longest > limit).nonzero().flatten()  # the whole batch evicts together
        n = to_device(lengths[due].long(), self.shape.device)[..., None]
        b = to_device(budgets[due], n.device)[:, None, None, None]
        sink = b.clamp(max=self.params.n_sink)
        t = torch.arange(int(lengths[due].max()), device=n.device)
        mask = torch.empty(*n.shape[:3], len(t), dtype=torch.bool, device=n.device)
        # sink + the recent window, written in place a few sequences at a time: the temporaries stay
        # within compaction's working memory however large the batch
        step = max(1, COMPACTION_CHUNK_BYTES // max(1, mask[0].numel()))
        for i in range(0, len(due), step):
            j = slice(i, i + step)
            torch.ge(t, n[j] - (b[j] - sink[j]), out=mask[j])
            mask[j] &= t < n[j]
            mask[j] |= t < sink[j]
        return KeepMask([seqs[i].seq_id for i in due.tolist()], mask)


def recent_and_sink(length: int, n_sink: int, budget: int) -> torch.Tensor:
    """Physical indices of the first ``n_sink`` and the most recent ``budget - n_sink`` tokens."""
    if length <= budget:
        return torch.arange(length)
    n_sink = min(n_sink, budget)
    return torch.cat([torch.arange(n_sink), torch.arange(length - (budget - n_sink), length)])
