"""Building an engine's parts from its config: device, dtype, KV pool size, attention backend."""

from __future__ import annotations

import torch

from engine.attention.reference import ReferenceAttention
from engine.config import ConfigError, EngineConfig

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device cuda was asked for, but torch sees no CUDA device")
    return device


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[name]


def staging_pages(fmt, max_cached_seqs: int, num_layers: int, num_kv_heads: int) -> int:
    """Full-precision staging pages a format needs (kivi: the open page and the residual window,
    ``staging_per_head`` per cached head; 0 for formats without staging)."""
    if not fmt.staging_per_head:
        return 0
    return max_cached_seqs * num_layers * num_kv_heads * fmt.staging_per_head + 1


def num_pages(cfg: EngineConfig, fmt, max_open: int, num_layers: int, num_kv_heads: int, device: torch.device) -> int:
    """Pages of the KV pool: ``num_pages`` if given, else what ``kv_cache_gb`` holds (2 GB on the
    CPU), else what ``gpu_memory_utilization`` of the GPU leaves after the model and a reserve for
    activations."""
    page_bytes = fmt.bytes_per_page + cfg.page_size * 4  # K/V storage + positions
    staging = max_open * fmt.open_page_bytes  # full-precision open and window pages (kivi)
    if cfg.num_pages is not None:
        return cfg.num_pages
    if cfg.kv_cache_gb is not None or device.type != "cuda":
        return max(1, int(((cfg.kv_cache_gb or 2.0) * 2**30 - staging) // page_bytes))
    free, total = torch.cuda.mem_get_info(device)
    # keep room for activations: the largest prefill chunk's attention and the logits
    reserve = max(2 * 2**30, int(0.04 * total))
    budget = int(total * cfg.gpu_memory_utilization) - (total - free) - reserve - staging
    if budget < page_bytes * num_layers * num_kv_heads:
        raise ConfigError(f"too little GPU memory left for the KV pool ({budget / 2**30:.1f} GiB)")
    return budget // page_bytes


def attention_backend(name: str, device: torch.device):
    """The attention backend ``name`` (``auto``: Triton on a GPU when it imports, else the reference)."""
    if name == "triton" or (name == "auto" and device.type == "cuda"):
        try:
            from engine.attention.triton_paged import TritonPagedAttention
        except ImportError:
            if name == "triton":
                raise ConfigError("attention_backend triton needs Triton and a CUDA device") from None
        else:
            return TritonPagedAttention(device)
    return ReferenceAttention()
