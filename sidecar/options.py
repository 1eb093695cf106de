"""ServerOptions: the sidecar's settings (listening, limits, snapshots, shutdown, auth, TLS).

``chainkv serve`` fills them from its flags, environment and YAML (``sidecar.serve_config``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from sidecar.auth import Authenticator
from sidecar.limits import TenantLimits
from sidecar.protocol import Limits


@dataclass
class ServerOptions:
    host: str = "127.0.0.1"
    port: int = 50051
    """0 picks a free port (``start`` returns it)."""
    max_message_bytes: int = 4 * 2**20
    """Largest request or response message; larger ones get RESOURCE_EXHAUSTED."""
    limits: Limits = field(default_factory=Limits)
    idempotency_window: int = 32
    """Completed turns remembered per session for request_id replay."""
    resume_wait_s: float = 5.0
    """How long a request waits for the store to catch up with its expected_turn_index."""
    snapshot_kv: bool = True
    """Snapshots carry the KV (resume without recompute); False: only the history."""
    snapshot_queue: int = 4096
    """Bound of the write-behind queue of dirty sessions."""
    snapshot_retry_max_s: float = 5.0
    session_idle_s: float = 3600.0
    """Sessions idle this long, with their snapshot committed, are freed here (they resume from the store)."""
    session_ttl_s: float = 7 * 24 * 3600.0
    """Sessions expire after this long unused: this replica ends one idle this long (with or without
    a store), and ``chainkv serve`` gives the store the same TTL, so a snapshot expires this long
    after its last write (CLI ``--session-ttl-s``, YAML ``session_ttl_s``)."""
    grace_s: float = 30.0
    """Shutdown: how long running turns may finish."""
    flush_timeout_s: float = 30.0
    """Shutdown: how long pending snapshots may take to write."""
    auth: Authenticator = field(default_factory=Authenticator)
    tenant_limits: TenantLimits = field(default_factory=TenantLimits)
    """Per-tenant quotas: live sessions, tokens per turn (sidecar/limits.py)."""
    durability: str = "async"
    """async: a turn's completion is sent at once, its snapshot written behind it; sync: only after
    its snapshot commits (a turn a client saw survives a crash of this replica)."""
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_client_ca: str | None = None
    """With a CA file, clients must present a certificate it signed (mutual TLS)."""
    allow_store_down: bool = False
    """Start even when the store does not answer (health NOT_SERVING until it does); False: refuse
    to start (``SidecarServer.start`` raises StoreUnavailable)."""
    store_check_s: float = 2.0
    """How often the store is pinged; while it does not answer, health is NOT_SERVING."""

    def __post_init__(self) -> None:
        for name in ("session_idle_s", "session_ttl_s"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a positive number of seconds, not {value!r}")
