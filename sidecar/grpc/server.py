"""The gRPC sidecar: ``chainkv.v1.Sidecar`` on grpc.aio, the engine stepping on a thread beside it.

    server = SidecarServer(engine, ServerOptions(port=50051), open_store("redis://localhost:6379"))
    port = await server.start()
    ...
    await server.stop()          # health NOT_SERVING, drain running turns, flush snapshots

This module is the sidecar's front door; the parts live one concept to a file:

- ``sidecar.grpc.options.ServerOptions``: the settings;
- ``sidecar.grpc.sidecar_server.SidecarServer``: the parts put together, started and stopped in order;
- ``sidecar.grpc.server_thread.ServerThread``: a SidecarServer on a background thread;
- ``sidecar.engine_bridge.client.EngineClient``: the only door to the engine thread (typed results in
  ``sidecar.engine_bridge.results``);
- ``sidecar.grpc.service.SidecarService``: the servicer; ``sidecar.turns.runner.TurnRunner``: one Turn's life,
  from the typed ``sidecar.turns.request.TurnRequest`` both fronts build;
- ``sidecar.grpc.errors.status_for``: exceptions -> status codes;
- ``sidecar.grpc.endpoint.GrpcEndpoint``: listening, TLS, health and reflection;
- ``sidecar.session_ids.SessionKey`` (a tenant's session and its stored key form),
  ``sidecar.sessions.manager.SessionManager`` (session id -> chain, ordering, idempotency, the store's one
  owner), ``sidecar.sessions.snapshots.SnapshotWriter`` (write-behind snapshots, given to the manager),
  ``sidecar.sessions.janitor`` (ending expired and freeing idle sessions), ``sidecar.turns.chat`` and
  ``sidecar.turns.tool_calls`` (chat in, tool calls out), ``sidecar.grpc.auth`` (bearer token -> tenant);
- ``sidecar.turns.hooks.ServerHooks``: callbacks at each RPC, turn and snapshot, for metrics.
"""

from __future__ import annotations

from sidecar.grpc.endpoint import SERVICE
from sidecar.grpc.errors import Draining, status_for
from sidecar.turns.hooks import ServerHooks
from sidecar.grpc.options import ServerOptions
from sidecar.grpc.server_thread import ServerThread
from sidecar.grpc.sidecar_server import SidecarServer
from sidecar.turns.errors import TurnAborted
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
