"""Prometheus metrics on a side port (``chainkv serve --metrics-port 9400``), plus an access log.

``MetricsHooks`` is a ``ServerHooks``: the servicer calls it at each RPC, turn, snapshot and
prune. Gauges that describe the engine (pages, sessions per tier) are read at scrape time on the
engine thread, between two steps, through the server's ``EngineClient`` (``stats_blocking``);
``MetricsHooks(engine)`` exports them once the server has started. Every metric is in the server's
own registry, so several servers in one process do not collide.

    chainkv_rpc_total{rpc, code}                    calls by final status code
    chainkv_rpc_seconds{rpc}                        call latency (Turn: the whole stream)
    chainkv_ttft_seconds                            time to first token of a turn
    chainkv_time_per_output_token_seconds           decode time per token after the first
    chainkv_turn_tokens_total{kind}                 prompt, reused, prefilled, generated, pruned
    chainkv_turns_total{tier}                       turns by where the session was found
    chainkv_pruned_tokens_total{source}             history tokens pruned (turn end, PruneHistory)
    chainkv_snapshot_seconds, chainkv_snapshot_bytes   committed snapshots
    chainkv_snapshot_failures_total{reason}         unavailable, conflict, refused, error
    chainkv_kv_pages{state}                         free / used pages of the KV pool
    chainkv_sessions{tier}                          sessions held here: gpu, host, history (recompute)
    chainkv_requests_running, chainkv_requests_waiting, chainkv_preemptions_total, chainkv_decoded_tokens_total
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Callable

import grpc
from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from sidecar._proto.chainkv.v1 import sidecar_pb2 as pb
from sidecar.engine_bridge.client import EngineClient
from sidecar.turns.hooks import ServerHooks

if TYPE_CHECKING:  # pragma: no cover
    from engine.api import EngineStats, LLMEngine

log = logging.getLogger(__name__)

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
PER_TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28)
TIER_NAMES = {v: k for k, v in pb.Tier.items()}
STATE_TIERS = {"idle": "gpu", "active": "gpu", "host": "host", "history": "history"}


class EngineCollector:
    """Engine gauges, read when Prometheus scrapes."""

    def __init__(self, read: Callable[[], EngineStats | None]):
        self.read = read

    def collect(self):
        stats = self.read()
        if stats is None:  # the engine is not serving (or did not answer in time)
            return
        pages = GaugeMetricFamily("chainkv_kv_pages", "KV pool pages by state", labels=["state"])
        pages.add_metric(["free"], stats.pages_free)
        pages.add_metric(["used"], stats.pages_total - stats.pages_free)
        yield pages
        tiers = dict.fromkeys(("gpu", "host", "history"), 0)
        for state, n in stats.sessions_by_state.items():
            tiers[STATE_TIERS.get(state, "gpu")] += n
        sessions = GaugeMetricFamily("chainkv_sessions", "sessions held by this replica, by tier", labels=["tier"])
        for tier, n in tiers.items():
            sessions.add_metric([tier], n)
        yield sessions
        yield GaugeMetricFamily("chainkv_requests_running", "requests being decoded or prefilled", value=stats.running)
        yield GaugeMetricFamily("chainkv_requests_waiting", "requests waiting for KV pages", value=stats.waiting)
        yield CounterMetricFamily(
            "chainkv_preemptions", "requests preempted for lack of pages", value=stats.preemptions
        )
        yield CounterMetricFamily("chainkv_decoded_tokens", "tokens decoded", value=stats.decoded_tokens)


class MetricsHooks(ServerHooks):
    def __init__(self, engine: "LLMEngine | None" = None, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.rpcs = Counter("chainkv_rpc", "Sidecar calls by final status", ["rpc", "code"], registry=r)
        self.rpc_seconds = Histogram(
            "chainkv_rpc_seconds", "Sidecar call latency", ["rpc"], buckets=LATENCY_BUCKETS, registry=r
        )
        self.ttft = Histogram(
            "chainkv_ttft_seconds", "time to first token of a turn", buckets=LATENCY_BUCKETS, registry=r
        )
        self.tpot = Histogram(
            "chainkv_time_per_output_token_seconds",
            "decode time per token after the first",
            buckets=PER_TOKEN_BUCKETS,
            registry=r,
        )
        self.turn_tokens = Counter("chainkv_turn_tokens", "tokens of completed turns", ["kind"], registry=r)
        self.turns = Counter("chainkv_turns", "completed turns by where the session was found", ["tier"], registry=r)
        self.pruned = Counter("chainkv_pruned_tokens", "history tokens whose KV was pruned", ["source"], registry=r)
        self.snapshot_seconds = Histogram(
            "chainkv_snapshot_seconds",
            "snapshot latency (take + serialize + commit)",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.snapshot_bytes = Counter("chainkv_snapshot_bytes", "KV bytes of committed snapshots", registry=r)
        self.snapshot_failures = Counter(
            "chainkv_snapshot_failures", "snapshot attempts that did not commit", ["reason"], registry=r
        )
        for reason in ("unavailable", "conflict", "refused", "error"):
            self.snapshot_failures.labels(reason)  # exported at 0 from the start
        self._client: EngineClient | None = None
        if engine is not None:
            r.register(EngineCollector(self._engine_stats))
        self._http = None

    def on_start(self, client: EngineClient) -> None:
        """The server started: engine gauges are read through its client, on the engine thread."""
        self._client = client

    def _engine_stats(self) -> EngineStats | None:
        if self._client is not None:
            return self._client.stats_blocking()
        return None

    # --- hooks ---------------------------------------------------------------------------------------
    def on_rpc(self, method: str, code: grpc.StatusCode, seconds: float) -> None:
        self.rpcs.labels(method, code.name).inc()
        self.rpc_seconds.labels(method).observe(seconds)
        level = logging.WARNING if code is grpc.StatusCode.INTERNAL else logging.INFO
        log.log(
            level,
            "rpc %s %s %.3fs",
            method,
            code.name,
            seconds,
            extra={"fields": {"rpc": method, "code": code.name, "seconds": round(seconds, 6)}},
        )

    def on_turn(self, completion: pb.TurnCompletion, seconds: float) -> None:
        u = completion.usage
        self.ttft.observe(u.time_to_first_token_s)
        if u.generated_tokens > 1:
            self.tpot.observe(max(0.0, seconds - u.time_to_first_token_s) / (u.generated_tokens - 1))
        for kind in ("prompt", "reused", "prefilled", "generated", "pruned"):
            self.turn_tokens.labels(kind).inc(getattr(u, f"{kind}_tokens"))
        self.turns.labels(TIER_NAMES.get(u.source_tier, "TIER_UNSPECIFIED")[5:].lower()).inc()
        if u.pruned_tokens:
            self.pruned.labels("turn").inc(u.pruned_tokens)

    def on_snapshot(self, key: str, nbytes: int, seconds: float) -> None:
        self.snapshot_seconds.observe(seconds)
        self.snapshot_bytes.inc(nbytes)

    def on_snapshot_failed(self, key: str, reason: str) -> None:
        self.snapshot_failures.labels(reason).inc()

    def on_prune(self, pruned_tokens: int, removed: int) -> None:
        self.pruned.labels("request").inc(pruned_tokens)

    # --- the side port --------------------------------------------------------------------------------
    def serve(self, port: int, host: str = "0.0.0.0") -> int:
        """Serve ``/metrics`` on ``host:port`` (0: a free port) from a daemon thread; returns the port."""
        server, _thread = start_http_server(port, addr=host, registry=self.registry)
        self._http = server
        return server.server_address[1]

    def close(self) -> None:
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None
