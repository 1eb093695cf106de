"""kvzip: keep the KV the model needs to repeat its context (query-agnostic, an extra pass).

Paper: Kim et al., "KVzip: Query-Agnostic KV Cache Compression with Context Reconstruction" (2025).
Rule: once a turn's input is in the cache, the model is prompted to reconstruct its context — the
repeat instruction (``prompt``, chat-formatted as a user turn when the tokenizer has a chat
template) followed by the context tokens themselves, fed as extra prefill after the cache. The
context is reconstructed in chunks of ``chunk_size`` tokens, each behind its own copy of the
instruction and each removed from the cache before the next (the paper's chunked scoring). A
cached token's score is the largest attention probability it receives from any reconstruction
query, over the query heads of its kv-head's GQA group (softmax over the whole cache plus the
reconstruction tokens, as in the paper). Each kv-head keeps its ``budget`` best tokens, the first
``n_sink`` always among them. (The paper's head-level variant and its one top-k across layers and
heads are not done here: every (layer, kv-head) keeps the same budget.)

Chain sessions: every turn reconstructs the whole logical history (its earlier turns too), so
every cached token is scored against the same query-agnostic task; the pass costs prefill of
about the history's length once per turn. The pass leaves no KV behind: its tokens are truncated
away, and the pool's free pages are back where they were before the keep decision.

Parameters:
    budget / budget_ratio    tokens kept per (layer, kv-head); required
    chunk_size = 2048        context tokens reconstructed per segment (the paper's chunk)
    n_sink = 4               leading tokens always kept
    prompt = "Repeat the previous context exactly."   the reconstruction instruction
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.cache.transfer import to_device
from engine.lifecycle import PrefillChunk, ScoringPass, SeqInfo, SparseMethod
from engine.method_spec import MethodError
from engine.methods.registry import register
from engine.methods.scored import topk_per_head


@dataclass
class KVzipParams:
    chunk_size: int = 2048
    n_sink: int = 4
    prompt: str = "Repeat the previous context exactly."


def reconstruction_scores(probs: torch.Tensor, context_lengths: torch.Tensor) -> torch.Tensor:
    """``[H, Tc]`` from a reconstruction chunk's probabilities ``[Hq, n, T]``: the largest
    probability each cached token receives from any query of its kv-head's group, -inf past each
    head's history (Tc = the longest history)."""
    Hq, n, T = probs.shape
    H = len(context_lengths)
    Tc = int(context_lengths.max())
    scores = probs[..., :Tc].float().reshape(H, Hq // H * n, Tc).amax(1)
    t = torch.arange(Tc, device=scores.device)
    return scores.masked_fill(t[None, :] >= to_device(context_lengths, scores.device)[:, None], float("-inf"))


@register
class KVzip(SparseMethod):
    name = "kvzip"
    Params = KVzipParams
    needs_budget = True
    holds_budget = True

    def __init__(self, spec, shape):
        super().__init__(spec, shape)
        p = self.params
        if p.chunk_size < 1 or p.n_sink < 0:
            raise MethodError("kvzip: chunk_size must be >= 1 and n_sink >= 0")
        self._scores: dict = {}  # (seq, layer) -> [H, Tc] running max
        self._lengths: dict = {}  # (seq, layer) -> [H] history lengths

    def repeat_prompt_ids(self, tokenizer) -> list[int]:
        """The instruction that precedes each reconstructed chunk (none without a tokenizer)."""
        if tokenizer is None:
            return []
        if getattr(tokenizer, "chat_template", None):
            ids = tokenizer.apply_chat_template(
                [{"role": "user", "content": self.params.prompt}], add_generation_prompt=True, tokenize=True
            )
            return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
        return tokenizer.encode("\n\n" + self.params.prompt + "\n\n", add_special_tokens=False)

    def reconstruction_segments(self, token_ids, tokenizer) -> list[list[int]]:
        prefix, c = self.repeat_prompt_ids(tokenizer), self.params.chunk_size
        return [prefix + list(token_ids[s : s + c]) for s in range(0, len(token_ids), c)]

    # --- hooks -----------------------------------------------------------------------------------
    def scoring_pass(self, seq: SeqInfo, token_ids, tokenizer) -> ScoringPass | None:
        if seq.num_tokens <= self.budget_for(seq.num_tokens):
            return None  # every head holds at most num_tokens: nothing to evict, no pass
        return ScoringPass(self.reconstruction_segments(token_ids, tokenizer))

    def observe_scoring(self, layer: int, chunk: PrefillChunk) -> None:
        key = (chunk.seq_id, layer)
        s = reconstruction_scores(chunk.probs, chunk.context_lengths)
        prev = self._scores.get(key)
        self._scores[key] = s if prev is None else torch.maximum(prev, s)
        self._lengths[key] = chunk.context_lengths.clone()

    def after_scoring(self, seq: SeqInfo):
        budget = self.budget_for(seq.num_tokens)
        out = {}
        for layer in range(self.shape.num_layers):
            scores = self._scores.pop((seq.seq_id, layer), None)
            lengths = self._lengths.pop((seq.seq_id, layer), None)
            if scores is None or int(lengths.max()) <= budget:
                continue
            scores = scores.clone()
            scores[:, : self.params.n_sink] = float("inf")  # past a head's end stays -inf via the lengths
            out[layer] = topk_per_head(scores, lengths, [budget] * len(lengths))
        return out or None

    def release(self, seq_id) -> None:
        for key in [k for k in self._scores if k[0] == seq_id]:
            self._scores.pop(key, None)
            self._lengths.pop(key, None)
