"""ServerOptions: every setting of the sidecar server, declared once.

Each field (and each field of its groups: the request ``Limits``, the ``TenantLimits``, the auth
settings) is one ``chainkv serve`` flag, one environment variable and one YAML key, named after it
(``session_ttl_s``: ``--session-ttl-s``, ``CHAINKV_SESSION_TTL_S``, ``session_ttl_s``); its default
and help text are here and nowhere else (sidecar/settings.py generates the rest; sidecar/cli/serve_config.py
reads them). A new setting is one field here, and the code that uses it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from sidecar.grpc.auth import Authenticator, AuthSettings
from sidecar.settings import setting, setting_group
from sidecar.turns.limits import TenantLimits
from sidecar.turns.protocol import Limits


@dataclass
class ServerOptions:
    # --- listening --------------------------------------------------------------------------------
    host: str = setting("127.0.0.1", "address to listen on (0.0.0.0 for every interface)")
    port: int = setting(50051, "0 picks a free port (printed at start)")
    """0 picks a free port (``start`` returns it)."""
    max_message_bytes: int = setting(4 * 2**20, "largest gRPC message accepted or sent")
    """Larger ones get RESOURCE_EXHAUSTED."""
    tls_cert: str | None = setting(None, "serve TLS with this certificate chain", metavar="PEM")
    tls_key: str | None = setting(None, "the certificate's private key", metavar="PEM")
    tls_client_ca: str | None = setting(None, "require client certificates signed by this CA", metavar="PEM")
    """With a CA file, clients must present a certificate it signed (mutual TLS)."""

    # --- what a request may hold, and who may send it --------------------------------------------------
    limits: Limits = setting_group(Limits)
    tenant_limits: TenantLimits = setting_group(TenantLimits)
    """Per-tenant quotas: live sessions, tokens per turn, pins (sidecar/turns/limits.py)."""
    auth: Authenticator = setting_group(AuthSettings, build=AuthSettings.authenticator)
    """Bearer tokens -> tenants, from ``--auth-token`` and ``--auth-file`` (sidecar/grpc/auth.py)."""

    # --- the session store and snapshots ------------------------------------------------------------
    store: str | None = setting(
        None,
        "session store: redis://host:port/db, rediss://..., file:///path (or a folder), or none "
        "(default: the folder sessions/ under $CHAINKV_CACHE or ~/.cache/chainkv)",
        metavar="URL",
    )
    """The store's URL; ``chainkv serve`` opens it (SidecarServer is given the opened store)."""
    snapshot_hmac_key_file: str | None = setting(
        None,
        "sign stored sessions with HMAC-SHA256 and refuse any that fail it (one key per line; "
        "the first signs, all verify)",
        metavar="FILE",
    )
    allow_store_down: bool = setting(
        False,
        "start even when the store does not answer: gRPC health NOT_SERVING (HTTP /health 503) "
        "until it does; without it, an unreachable store stops the start (exit code 2)",
    )
    """False: ``SidecarServer.start`` raises StoreUnavailable when the store does not answer."""
    store_check_s: float = setting(
        2.0, "how often the store is pinged; while it does not answer, health is NOT_SERVING"
    )
    snapshot_kv: bool = setting(
        True, "snapshots carry the KV (resume without recompute); --no-snapshot-kv keeps only the history"
    )
    snapshot_queue: int = setting(4096, "bound of the write-behind queue of dirty sessions")
    snapshot_retry_max_s: float = setting(5.0, "longest wait between retries of a snapshot write that failed")
    durability: str = setting(
        "async",
        "async: a turn's completion is sent at once and its snapshot written behind it; sync: "
        "only after its snapshot commits (no acknowledged turn is lost if this replica dies)",
        choices=("async", "sync"),
    )

    # --- sessions ---------------------------------------------------------------------------------
    session_idle_s: float = setting(
        3600.0, "free sessions idle this long whose snapshot is committed (they resume from the store)"
    )
    session_ttl_s: float = setting(
        7 * 24 * 3600.0,
        "sessions unused this long expire: ended on the replica, and their stored "
        "snapshots expire this long after their last write",
        metavar="SECONDS",
        aliases=("--store-ttl",),
    )
    """This replica ends a session idle this long (with or without a store), and ``chainkv serve``
    gives the store the same TTL."""
    idempotency_window: int = setting(32, "completed turns remembered per session for request_id replay")
    resume_wait_s: float = setting(
        5.0, "how long a request waits for the store to catch up with its expected_turn_index"
    )

    # --- shutdown ---------------------------------------------------------------------------------
    grace_s: float = setting(30.0, "shutdown: time for running turns to finish")
    flush_timeout_s: float = setting(30.0, "shutdown: time for pending snapshots to be written")

    # --- the other fronts and logging (chainkv serve) -----------------------------------------------
    http_port: int | None = setting(
        None,
        "also serve the OpenAI-compatible HTTP API on this port (0 picks one); unset: no HTTP",
        metavar="PORT",
    )
    http_host: str | None = setting(None, "address of the HTTP port (default: --host)")
    served_model_name: str | None = setting(None, "the model name HTTP clients send (default: the model folder's name)")
    metrics_port: int | None = setting(
        None, "serve Prometheus metrics on this port (0 picks one); unset: no metrics", metavar="PORT"
    )
    metrics_host: str = setting("127.0.0.1", "address of the metrics port (like --host: 0.0.0.0 for every interface)")
    log_level: str = setting("INFO", "DEBUG, INFO, WARNING, ...")
    log_format: str = setting("text", "json: one object per line", choices=("text", "json"))

    def __post_init__(self) -> None:
        for name in ("session_idle_s", "session_ttl_s"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a positive number of seconds, not {value!r}")
