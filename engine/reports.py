"""What the engine reports about itself: the model it serves (``ModelInfo``) and its counters
(``EngineStats``), typed and frozen so they may be read on another thread."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class ModelInfo:
    """What the engine serves (``LLMEngine.model_info``; the sidecar's GetServerInfo, ``/v1/models``)."""

    name: str
    architecture: str
    max_model_len: int
    vocab_size: int
    method: str
    """The engine's default sparse method."""
    fingerprint: str
    """What KV computed here depends on: a snapshot from another fingerprint is recomputed."""
    prune_roles: tuple[str, ...]
    prune_lag: int | None


@dataclass(frozen=True)
class EngineStats:
    """The engine's counters (``LLMEngine.stats``), read together between two steps."""

    pages_total: int
    pages_free: int
    running: int
    """Requests being prefilled or decoded."""
    waiting: int
    preemptions: int
    forward_passes: int
    graph_steps: int
    """Decode steps replayed as CUDA graphs."""
    evicted_pages: int
    evicted_tokens: int
    sessions: int
    demotions: int
    swaps: int
    prefetches: int
    """Sessions brought back from host memory ahead of the next turn their agent announced
    (the ``expected_return_s`` hint), ..."""
    prefetch_hits: int
    """... and those whose next turn found them still on the GPU."""
    prefix_holders: int
    decoded_tokens: int
    finished_stop: int
    finished_length: int
    finished_abort: int
    finished_error: int
    finished_failed: int
    recall_d2h_bytes: int
    """The recall tier's copies since the engine started: bytes to the host, ..."""
    recall_h2d_bytes: int
    """... bytes to the device, ..."""
    recall_pages_fetched: int
    recalled_tokens: int
    """... fetched tokens kept on the device, ..."""
    recalls: int
    recall_host_bytes: int
    """Host memory the recall tier holds now."""
    recall_staging_buffers: int
    """Copies to the host still in flight."""
    sessions_by_state: dict[str, int] = field(default_factory=dict)
    """idle, active, host, history -> sessions."""
