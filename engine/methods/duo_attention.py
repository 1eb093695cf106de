"""duo_attention: retrieval heads keep the whole KV, streaming heads keep sink + recent tokens.

Paper: Xiao et al., "DuoAttention: Efficient Long-Context LLM Inference with Retrieval and
Streaming Heads" (ICLR 2025); reference code mit-han-lab/duo-attention (``duo_attn/patch/``,
``attn_patterns/``).
Rule: a calibration gives every (layer, kv-head) a score of how much it needs distant context
(``chainkv calibrate duo_attention``, on locally generated passkey-retrieval data; see
engine/methods/duo_calibration.py). The ``sparsity`` fraction of heads with the lowest scores become
*streaming heads*: after every prefill chunk and decode step they keep only their first ``n_sink``
tokens and their most recent ones, and the rest of their pages go back to the pool. The other
(*retrieval*) heads keep every token. Memory falls with the sparsity while the heads that retrieve
keep full context. Only the calibration differs from the paper: it optimises a gate per head by
distillation; ours scores each head by the attention mass its answer-time queries put outside the
sink + recent window (training-free; the head pattern has the same form).

Tensor parallelism: no communication at run time. Which heads stream is ranked over all (layer,
kv-head)s of the model, so every rank loads the whole pattern, ranks it, and keeps the rows of its
own kv-heads; each head's rule is then its own.

Parameters:
    budget / budget_ratio   tokens a streaming head keeps (sink + recent); unset: n_sink + n_recent
    n_sink = 128            sink tokens a streaming head keeps (with a budget: at most a quarter of it)
    n_recent = 256          recent tokens a streaming head keeps when no budget is given
    sparsity = 0.5          fraction of (layer, kv-head)s that stream
    pattern = "auto"        a head-pattern JSON file; auto: the shipped pattern whose model shape
                            matches (engine/methods/patterns/duo_attention-*.json)
    slack = 0               tokens a streaming head may grow past its budget before it is trimmed
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.distributed import group
from engine.lifecycle import DecodeBatch, PrefillChunk, SparseMethod
from engine.method_spec import MethodError
from engine.methods.streaming_llm import recent_and_sink
from engine.methods.registry import register

PATTERN_DIR = Path(__file__).parent / "patterns"


@dataclass
class DuoAttentionParams:
    n_sink: int = 128
    n_recent: int = 256
    sparsity: float = 0.5
    pattern: str = "auto"
    slack: int = 0


def load_pattern(pattern: str, num_layers: int, num_kv_heads: int, head_dim: int) -> dict:
    """A head pattern (``scores`` ``[L][H]``) from a file, or the shipped one matching the shape."""
    shape = (num_layers, num_kv_heads, head_dim)
    if pattern == "auto":
        for path in sorted(PATTERN_DIR.glob("duo_attention-*.json")):
            data = json.loads(path.read_text())
            if (data["num_layers"], data["num_kv_heads"], data["head_dim"]) == shape:
                return data
        raise MethodError(
            f"duo_attention: no shipped head pattern for a model of (layers, kv-heads, head_dim) {shape}; "
            "run `chainkv calibrate duo_attention --out FILE` and pass --method-arg pattern=FILE"
        )
    path = Path(pattern)
    if not path.is_file():
        raise MethodError(f"duo_attention: head pattern file {pattern!r} not found")
    data = json.loads(path.read_text())
    if (data.get("num_layers"), data.get("num_kv_heads"), data.get("head_dim")) != shape:
        raise MethodError(
            f"duo_attention: {pattern} is for (layers, kv-heads, head_dim) "
            f"{(data.get('num_layers'), data.get('num_kv_heads'), data.get('head_dim'))}, this model is {shape}"
        )
    return data


def streaming_heads(scores: torch.Tensor, sparsity: float) -> torch.Tensor:
    """``[L, H]`` bool: the ``sparsity`` fraction of heads with the lowest scores (ties: lower index first)."""
    n = round(sparsity * scores.numel())
    order = torch.sort(scores.reshape(-1), stable=True).indices
    mask = torch.zeros(scores.numel(), dtype=torch.bool)
    mask[order[:n]] = True
    return mask.view_as(scores)


@register
class DuoAttention(SparseMethod):
    name = "duo_attention"
    Params = DuoAttentionParams

    def __init__(self, spec, shape):
        super().__init__(spec, shape)
        p = self.params
        if p.n_sink < 0 or p.n_recent < 1 or p.slack < 0:
            raise MethodError("duo_attention: n_sink and slack must be >= 0, n_recent >= 1")
        if not 0 <= p.sparsity <= 1:
            raise MethodError(f"duo_attention.sparsity must be in [0, 1], not {p.sparsity}")
        H = shape.num_kv_heads  # this rank's kv-heads (all of them at tensor_parallel_size 1)
        data = load_pattern(p.pattern, shape.num_layers, H * group.size(), shape.head_dim)
        self.scores = torch.tensor(data["scores"], dtype=torch.float32)
        mine = slice(group.rank() * H, (group.rank() + 1) * H)
        self.streaming = streaming_heads(self.scores, p.sparsity)[:, mine]  # [L, H], ranked over the whole model
        self.scores = self.scores[:, mine]
        self._any = self.streaming.any(-1).tolist()

    def streaming_budget(self, num_tokens: int) -> tuple[int, int]:
        """(sink, total) tokens a streaming head keeps."""
        budget = self.budget_for(num_tokens)
        if budget is None:
            return self.params.n_sink, self.params.n_sink + self.params.n_recent
        return min(self.params.n_sink, budget // 4), budget

    def _keep(self, layer: int, lengths: torch.Tensor, num_tokens: int, slack: int):
        if not self._any[layer]:
            return None
        sink, budget = self.streaming_budget(num_tokens)
        stream = self.streaming[layer]
        if int(lengths[stream].max()) <= budget + slack:
            return None
        return [
            recent_and_sink(int(n), sink, budget) if stream[h] else torch.arange(int(n)) for h, n in enumerate(lengths)
        ]

    def after_prefill_chunk(self, layer: int, chunk: PrefillChunk):
        return self._keep(layer, chunk.lengths, chunk.num_tokens, 0)

    def decode_hooks_due(self, seq_ids, lengths) -> bool:
        if not any(self._any):
            return False
        if self.spec.budget_ratio is not None:
            return True
        _, budget = self.streaming_budget(0)
        return int(lengths[:, self.streaming].max()) > budget + self.params.slack

    def after_decode(self, layer: int, batch: DecodeBatch):
        out = {}
        for i, seq_id in enumerate(batch.seq_ids):
            keep = self._keep(layer, batch.lengths[i], batch.num_tokens[i], self.params.slack)
            if keep is not None:
                out[seq_id] = keep
        return out
