"""ServerHooks: callbacks at each RPC, turn, snapshot and prune, so metrics attach without touching the servicer.

The defaults do nothing; ``sidecar.grpc.metrics.MetricsHooks`` overrides them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import grpc

from sidecar._proto.chainkv.v1 import sidecar_pb2 as pb

if TYPE_CHECKING:  # pragma: no cover
    from sidecar.engine_bridge.client import EngineClient


class ServerHooks:
    """Callbacks at interesting points; the defaults do nothing (a metrics exporter overrides them)."""

    def on_start(self, client: "EngineClient") -> None:
        """The server started; ``client`` is its door to the engine (e.g. to read its counters)."""

    def on_rpc(self, method: str, code: grpc.StatusCode, seconds: float) -> None:
        pass

    def on_turn(self, completion: pb.TurnCompletion, seconds: float) -> None:
        pass

    def on_snapshot(self, key: str, nbytes: int, seconds: float) -> None:
        pass

    def on_snapshot_failed(self, key: str, reason: str) -> None:
        """A snapshot attempt that did not commit (store down, conflict, refused)."""

    def on_prune(self, pruned_tokens: int, removed: int) -> None:
        """A PruneHistory call pruned ``pruned_tokens`` history tokens (``removed`` KV entries)."""
