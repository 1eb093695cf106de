"""Our Llama-family decoder: Llama 2/3.x, Mistral, Qwen2/2.5 (q/k/v bias) and Qwen3 (q/k norm).

The forward pass takes the flattened tokens of a whole batch (prefill chunks and decodes side by
side) and hands every layer's attention to a callable, ``attend(layer, q, k, v) -> out``, which the
runner binds to the paged KV cache, the sparse method's views and an attention backend. Nothing
here knows about pages or sparse methods.

Numerics follow the HF implementation (it is the parity oracle): RMSNorm in float32, RoPE cos/sin
computed in float32 and cast to the model dtype, rotate-half RoPE applied after the Qwen3 q/k norm.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from engine.model import ops
from engine.model.loader import ModelConfig, ModelLoadError

AttendFn = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype=None, device=None):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype, device=device), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """``norm(x)``, or with ``residual``: ``(norm(x + residual), x + residual)``."""
        if residual is None:
            return ops.rms_norm(x, self.weight, self.eps)
        return ops.add_rms_norm(x, residual, self.weight, self.eps)


def rope_tables(hf_config: Any, head_dim: int, max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape [max_len, head_dim] in float32, as HF's rotary embedding computes them."""
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        base = params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
        scaling = 1.0
    else:
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        if rope_type not in ROPE_INIT_FUNCTIONS:
            raise ModelLoadError(f"unsupported RoPE type {rope_type!r}")
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config, "cpu")
    positions = torch.arange(max_len, dtype=torch.float)
    freqs = positions[:, None] * inv_freq.float()[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos() * scaling, emb.sin() * scaling


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype=None, device=None):
        super().__init__()
        self.cfg = cfg
        f = {"dtype": dtype, "device": device}
        q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, **f)
        self.qkv_proj = nn.Linear(cfg.hidden_size, q_size + 2 * kv_size, bias=cfg.attention_bias, **f)
        self.o_proj = nn.Linear(q_size, cfg.hidden_size, bias=False, **f)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, **f)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, **f)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, **f)
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False, **f)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False, **f)
        self.split = (q_size, kv_size, kv_size)

    def forward(
        self,
        layer: int,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        positions: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attend: AttendFn,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer on (the previous layer's output, the residual stream): returns both for the next."""
        cfg = self.cfg
        n = x.shape[0]
        if residual is None:
            h, residual = self.input_layernorm(x), x
        else:
            h, residual = self.input_layernorm(x, residual)
        q, k, v = self.qkv_proj(h).split(self.split, dim=-1)
        q = q.view(n, cfg.num_heads, cfg.head_dim)
        k = k.view(n, cfg.num_kv_heads, cfg.head_dim)
        v = v.view(n, cfg.num_kv_heads, cfg.head_dim)
        if cfg.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = ops.rope(q, k, positions, cos, sin)
        attn = attend(layer, q, k, v)
        h, residual = self.post_attention_layernorm(self.o_proj(attn.reshape(n, -1)), residual)
        return self.down_proj(ops.silu_mul(self.gate_up_proj(h))), residual


class LlamaForCausalLM(nn.Module):
    """Parameters are created directly in ``dtype`` on ``device`` (no float32 detour for 8B models);
    the RoPE tables stay float32."""

    def __init__(self, cfg: ModelConfig, hf_config: Any, max_len: int, dtype=torch.float32, device="cpu"):
        super().__init__()
        self.cfg = cfg
        f = {"dtype": dtype, "device": device}
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, **f)
        self.layers = nn.ModuleList(DecoderLayer(cfg, **f) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, **f)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False, **f)
        cos, sin = rope_tables(hf_config, cfg.head_dim, max_len)
        self.register_buffer("rope_cos", cos.to(device), persistent=False)
        self.register_buffer("rope_sin", sin.to(device), persistent=False)
        self.requires_grad_(False)

    @classmethod
    def create(cls, cfg: ModelConfig, hf_config: Any, max_len: int, dtype: torch.dtype, device) -> "LlamaForCausalLM":
        """An uninitialised model on ``device`` (no time spent on random init); load or init it next."""
        model = cls(cfg, hf_config, max_len, dtype=dtype, device="meta").to_empty(device=device)
        cos, sin = rope_tables(hf_config, cfg.head_dim, max_len)
        model.rope_cos, model.rope_sin = cos.to(device), sin.to(device)
        return model

    def init_random(self, seed: int = 0, std: float = 0.02) -> None:
        """Random weights with real shapes (throughput benchmarks): normal(0, std), norms at 1."""
        gen = torch.Generator(device=self.rope_cos.device).manual_seed(seed)
        with torch.no_grad():
            for name, p in self.named_parameters():
                if name.endswith("norm.weight"):
                    p.fill_(1.0)
                elif name.endswith("bias"):
                    p.zero_()
                else:
                    p.normal_(0.0, std, generator=gen)

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attend: AttendFn,
        logits_indices: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits for the tokens at ``logits_indices`` (all tokens when None)."""
        x = self.embed_tokens(input_ids)
        residual = None
        for i, layer in enumerate(self.layers):
            x, residual = layer(i, x, residual, positions, self.rope_cos, self.rope_sin, attend)
        if logits_indices is not None:
            x, residual = x[logits_indices], residual[logits_indices]
        h, _ = self.norm(x, residual)
        return self.logits(h)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """float32 logits of final hidden states (a tensor-parallel shard gathers its vocabulary slice)."""
        return F.linear(h, self.lm_head_weight).float()

    def load_weights(self, tensors: dict[str, torch.Tensor]) -> None:
        """Copy HF-named tensors into our (fused) parameters; every parameter must be filled."""
        cfg = self.cfg
        tensors = {k.removeprefix("model."): v for k, v in tensors.items()}
        filled: set[str] = set()

        def take(name: str) -> torch.Tensor:
            if name not in tensors:
                raise ModelLoadError(f"weight {name!r} is missing from the checkpoint")
            filled.add(name)
            return tensors[name]

        with torch.no_grad():
            self.embed_tokens.weight.copy_(take("embed_tokens.weight"))
            self.norm.weight.copy_(take("norm.weight"))
            if self.lm_head is not None:
                self.lm_head.weight.copy_(take("lm_head.weight"))
            for i, layer in enumerate(self.layers):
                p = f"layers.{i}."
                layer.input_layernorm.weight.copy_(take(p + "input_layernorm.weight"))
                layer.post_attention_layernorm.weight.copy_(take(p + "post_attention_layernorm.weight"))
                layer.qkv_proj.weight.copy_(torch.cat([take(p + f"self_attn.{n}_proj.weight") for n in "qkv"]))
                if cfg.attention_bias:
                    layer.qkv_proj.bias.copy_(torch.cat([take(p + f"self_attn.{n}_proj.bias") for n in "qkv"]))
                layer.o_proj.weight.copy_(take(p + "self_attn.o_proj.weight"))
                if cfg.qk_norm:
                    layer.q_norm.weight.copy_(take(p + "self_attn.q_norm.weight"))
                    layer.k_norm.weight.copy_(take(p + "self_attn.k_norm.weight"))
                layer.gate_up_proj.weight.copy_(
                    torch.cat([take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")])
                )
                layer.down_proj.weight.copy_(take(p + "mlp.down_proj.weight"))
        # a tied checkpoint may still carry lm_head.weight (a copy of the embeddings)
        unused = sorted(set(tensors) - filled - {"lm_head.weight"} - {k for k in tensors if "rotary_emb" in k})
        if unused:
            raise ModelLoadError(f"checkpoint has weights this architecture does not use: {unused[:5]}")
