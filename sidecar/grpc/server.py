"""The gRPC sidecar: ``chainkv.v1.Sidecar`` on grpc.aio, the engine stepping on a thread beside it.

    server = SidecarServer(engine, ServerOptions(port=50051), open_store("redis://localhost:6379"))
    port = await server.start()
    ...
    await server.stop()          # health NOT_SERVING, drain running turns, flush snapshots

This module is the sidecar's front door: what an embedder imports. The parts live one concept to a
file, grouped into rooms (docs/architecture.md, the sidecar's module map): ``sidecar.grpc`` (this
server: ``SidecarServer`` in sidecar_server.py, the servicer, the endpoint, the status table, the
settings in ``ServerOptions``), ``sidecar.turns`` (``TurnRunner``, the typed ``TurnRequest`` both
fronts build, ``ServerHooks``), ``sidecar.sessions`` (``SessionManager``, the store's one owner, and
the ``SnapshotWriter`` it is given), ``sidecar.engine_bridge`` (``EngineClient``, the only door to the
engine thread) and ``sidecar.store``.
"""

from __future__ import annotations

from sidecar.grpc.endpoint import SERVICE
from sidecar.grpc.errors import Draining, status_for
from sidecar.grpc.options import ServerOptions
from sidecar.grpc.server_thread import ServerThread
from sidecar.grpc.sidecar_server import SidecarServer
from sidecar.turns.errors import TurnAborted
from sidecar.turns.hooks import ServerHooks
from sidecar.turns.runner import replay_events

__all__ = [
    "SERVICE",
    "Draining",
    "ServerHooks",
    "ServerOptions",
    "ServerThread",
    "SidecarServer",
    "TurnAborted",
    "replay_events",
    "status_for",
]
