"""What one tensor-parallel rank owns: query heads, kv-heads, MLP rows, a slice of the vocabulary.

Megatron-style split of a Llama-family decoder over ``size`` ranks:

- attention: rank r computes query heads ``[r*Hq/size, (r+1)*Hq/size)`` and kv-heads
  ``[r*H/size, (r+1)*H/size)`` (column-parallel q/k/v: whole GQA groups stay on one rank), then
  its rows of o_proj (row-parallel: the partial outputs are summed over ranks);
- MLP: columns ``[r*I/size, ...)`` of gate/up (column-parallel), the same rows of down_proj
  (row-parallel, summed);
- vocabulary: the embedding and the LM head hold ``ceil(V/size)`` rows each (the last rank's
  padded with zeros); lookups are summed over ranks, logits gathered and cut back to ``V``.

Norms (and Qwen3's per-head q/k norms) are replicated. The number of kv-heads must divide by
``size``: a kv-head's pages, and its sparse method's decisions, then live on exactly one rank.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from engine.model.loader import ModelConfig


class ShardingError(ValueError):
    """The model cannot be split over this many ranks."""


@dataclass(frozen=True)
class ShardLayout:
    size: int
    rank: int
    num_heads: int
    """Query heads of this rank."""
    num_kv_heads: int
    """kv-heads of this rank (its CacheManager holds only these)."""
    intermediate: int
    vocab_shard: int
    """Rows of the embedding / LM head per rank (the vocabulary rounded up to a multiple of size)."""
    vocab_size: int

    @classmethod
    def of(cls, mc: ModelConfig, size: int, rank: int) -> "ShardLayout":
        if size < 1 or not 0 <= rank < size:
            raise ShardingError(f"bad tensor-parallel rank {rank} of {size}")
        for what, n in (
            ("kv-heads", mc.num_kv_heads),
            ("query heads", mc.num_heads),
            ("MLP columns (intermediate_size)", mc.intermediate_size),
        ):
            if n % size:
                raise ShardingError(f"tensor_parallel_size {size} does not divide the model's {n} {what}")
        return cls(
            size=size,
            rank=rank,
            num_heads=mc.num_heads // size,
            num_kv_heads=mc.num_kv_heads // size,
            intermediate=mc.intermediate_size // size,
            vocab_shard=-(-mc.vocab_size // size),
            vocab_size=mc.vocab_size,
        )

    @property
    def kv_heads(self) -> range:
        """This rank's kv-heads, numbered in the whole model."""
        return range(self.rank * self.num_kv_heads, (self.rank + 1) * self.num_kv_heads)

    @property
    def vocab_start(self) -> int:
        return self.rank * self.vocab_shard

    def local_config(self, mc: ModelConfig) -> ModelConfig:
        """The shape of this rank's part of the model (what its modules are built with)."""
        return dataclasses.replace(
            mc,
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            intermediate_size=self.intermediate,
            vocab_size=self.vocab_shard,
        )

    # --- weights -------------------------------------------------------------------------------
    def _rows(self, t: torch.Tensor, per_rank: int) -> torch.Tensor:
        return t[self.rank * per_rank : (self.rank + 1) * per_rank]

    def _cols(self, t: torch.Tensor, per_rank: int) -> torch.Tensor:
        return t[:, self.rank * per_rank : (self.rank + 1) * per_rank]

    def _vocab_rows(self, t: torch.Tensor) -> torch.Tensor:
        part = t[self.vocab_start : self.vocab_start + self.vocab_shard]
        if part.shape[0] < self.vocab_shard:  # the last rank's padding rows: never looked up, logits cut
            pad = torch.zeros(self.vocab_shard - part.shape[0], *t.shape[1:], dtype=t.dtype, device=t.device)
            part = torch.cat([part, pad])
        return part

    def shard_weights(self, tensors: dict[str, torch.Tensor], head_dim: int) -> dict[str, torch.Tensor]:
        """HF-named checkpoint tensors -> this rank's slices under the same names."""
        q, kv, inter = self.num_heads * head_dim, self.num_kv_heads * head_dim, self.intermediate
        out = {}
        for name, t in tensors.items():
            base = name.removeprefix("model.")
            if base.endswith(("embed_tokens.weight",)) or base == "lm_head.weight":
                out[name] = self._vocab_rows(t)
            elif base.endswith("self_attn.q_proj.weight") or base.endswith("self_attn.q_proj.bias"):
                out[name] = self._rows(t, q)
            elif base.endswith(
                ("self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.k_proj.bias", "self_attn.v_proj.bias")
            ):
                out[name] = self._rows(t, kv)
            elif base.endswith("self_attn.o_proj.weight"):
                out[name] = self._cols(t, q)
            elif base.endswith(("mlp.gate_proj.weight", "mlp.up_proj.weight")):
                out[name] = self._rows(t, inter)
            elif base.endswith("mlp.down_proj.weight"):
                out[name] = self._cols(t, inter)
            else:  # norms (and rotary buffers, which loading skips): every rank has them whole
                out[name] = t
        return out


def shard_layout(config, mc: ModelConfig) -> ShardLayout | None:
    """This process's layout for an engine of ``config`` (None at tensor_parallel_size 1). The
    process must already be in the TP group (engine/tensor_parallel/launcher.py puts it there)."""
    from engine.distributed import group

    tp = config.tensor_parallel_size
    if tp == 1:
        return None
    if group.size() != tp:
        raise group.TensorParallelError(
            f"tensor_parallel_size is {tp} but this process is in a group of {group.size()}: start the engine through "
            "engine.tensor_parallel.launcher (or `chainkv serve`), which runs one process per rank"
        )
    return ShardLayout.of(mc, tp, group.rank())
