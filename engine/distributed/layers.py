"""Tensor-parallel modules and the sharded Llama-family model.

The decoder layer itself is unchanged (engine/model/llama.py): built with a rank's local shape it
runs that rank's heads and MLP columns. Two of its modules are swapped for row-parallel ones that
sum their partial outputs over ranks (o_proj, down_proj); the embedding looks up only its slice of
the vocabulary (rows of other ranks read as zero, the sum over ranks fills them); the LM head
computes its slice of the logits, which are gathered, so every rank samples from the same full row.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from engine.distributed import group
from engine.distributed.sharding import ShardLayout
from engine.model.llama import LlamaForCausalLM
from engine.model.loader import ModelConfig


class RowParallelLinear(nn.Linear):
    """``x @ W_r.T`` over this rank's input columns, summed over ranks (no bias in Llama's o/down)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return group.all_reduce_sum(super().forward(x))


class VocabParallelEmbedding(nn.Embedding):
    """The rows ``[start, start + n)`` of the vocabulary; other ids look up zeros, then the sum
    over ranks gives every token its row."""

    def __init__(self, num_embeddings: int, embedding_dim: int, start: int, **kw):
        super().__init__(num_embeddings, embedding_dim, **kw)
        self.start = start

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        mine = (local >= 0) & (local < self.num_embeddings)
        out = F.embedding(local.clamp(0, self.num_embeddings - 1), self.weight)
        out = out * mine.unsqueeze(-1).to(out.dtype)
        return group.all_reduce_sum(out)


class TensorParallelLlama(LlamaForCausalLM):
    """One rank's shard of a Llama-family decoder: ``forward`` returns the full ``[n, V]`` logits
    on every rank. Build it with :meth:`create_shard`."""

    layout: ShardLayout

    def __init__(
        self,
        cfg: ModelConfig,
        hf_config: Any,
        max_len: int,
        dtype=torch.float32,
        device="cpu",
        layout: ShardLayout | None = None,
    ):
        super().__init__(cfg, hf_config, max_len, dtype=dtype, device=device)
        self.layout = layout
        f = {"dtype": dtype, "device": device}
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, layout.vocab_start, **f)
        for layer in self.layers:
            layer.o_proj = RowParallelLinear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=False, **f)
            layer.down_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, bias=False, **f)
        self.requires_grad_(False)

    @classmethod
    def create_shard(
        cls, mc: ModelConfig, layout: ShardLayout, hf_config: Any, max_len: int, dtype: torch.dtype, device
    ) -> "TensorParallelLlama":
        """An uninitialised shard on ``device`` (``mc`` is the whole model's shape)."""
        from engine.model.llama import rope_tables

        local = layout.local_config(mc)
        model = cls(local, hf_config, max_len, dtype=dtype, device="meta", layout=layout).to_empty(device=device)
        cos, sin = rope_tables(hf_config, mc.head_dim, max_len)
        model.rope_cos, model.rope_sin = cos.to(device), sin.to(device)
        return model

    def load_weights(self, tensors: dict[str, torch.Tensor]) -> None:
        """Whole-model HF tensors in; this rank's slices are copied."""
        super().load_weights(self.layout.shard_weights(tensors, self.cfg.head_dim))

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return group.all_gather_last(F.linear(h, self.lm_head_weight).float())[..., : self.layout.vocab_size]
