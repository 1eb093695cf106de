"""streaming_llm: attention sinks plus a sliding window of recent tokens.

Paper: Xiao et al., "Efficient Streaming Language Models with Attention Sinks" (ICLR 2024).
Rule: keep the first ``n_sink`` tokens (the attention sinks) and the most recent
``budget - n_sink`` tokens of every (layer, kv-head); evict the rest. It evicts after every prefill
chunk, so a long prompt never holds more than ``budget`` + one chunk, and after every decode step
once a head exceeds its budget.

Parameters:
    budget / budget_ratio   tokens kept per head (sink + window); required
    n_sink = 4              attention-sink tokens kept at the start (the paper uses 4)
    slack = 0               let a head grow this many tokens past the budget before evicting it
                            back to the budget (0 is the paper's rule; a page of slack makes
                            decode-time eviction one compaction every page, and the steps in
                            between CUDA-graph decodes)
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.lifecycle import DecodeBatch, MethodError, PrefillChunk, SparseMethod, recent_and_sink


@dataclass
class StreamingLLMParams:
    n_sink: int = 4
    slack: int = 0


class StreamingLLM(SparseMethod):
    name = "streaming_llm"
    Params = StreamingLLMParams
    needs_budget = True

    def __init__(self, spec, shape):
        super().__init__(spec, shape)
        if self.params.n_sink < 0 or self.params.slack < 0:
            raise MethodError("streaming_llm.n_sink and streaming_llm.slack must be >= 0")
        if spec.budget is not None and spec.budget <= self.params.n_sink:
            raise MethodError(f"streaming_llm budget ({spec.budget}) must exceed n_sink ({self.params.n_sink})")

    def kept_tokens(self, num_tokens: int) -> int:
        return min(num_tokens, self.budget_for(num_tokens))

    def _keep(self, lengths, num_tokens: int, slack: int):
        budget = self.budget_for(num_tokens)
        if int(lengths.max()) <= budget + slack:
            return None
        if bool((lengths == lengths[0]).all()):  # the usual case: every head holds the same tokens
            return recent_and_sink(int(lengths[0]), self.params.n_sink, budget).expand(len(lengths), -1)
        return [recent_and_sink(int(n), self.params.n_sink, budget) for n in lengths]

    def after_prefill_chunk(self, layer: int, chunk: PrefillChunk):
        return self._keep(chunk.lengths, chunk.num_tokens, 0)

    def decode_hooks_due(self, seq_ids, lengths) -> bool:
        if self.spec.budget is None:  # a ratio budget moves with each sequence's length: check every step
            return True
        return int(lengths.max()) > self.spec.budget + self.params.slack

    def after_decode(self, layer: int, batch: DecodeBatch):
        rows = range(len(batch.seq_ids))
        if self.spec.budget is not None:  # only the rows past budget + slack
            rows = (batch.lengths.max(-1).values > self.spec.budget + self.params.slack).nonzero().flatten().tolist()
        out = {}
        for i in rows:
            keep = self._keep(batch.lengths[i], batch.num_tokens[i], self.params.slack)
            if keep is not None:
                out[batch.seq_ids[i]] = keep
        return out
