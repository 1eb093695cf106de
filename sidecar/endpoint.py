"""The gRPC endpoint: the grpc.aio server with its message limits, TLS, health and reflection.

``GrpcEndpoint`` owns the listening side of the sidecar and nothing else: it adds the servicer's
handlers, the standard health service (``grpc.health.v1``, reported for "" and
``chainkv.v1.Sidecar``) and server reflection (v1 and v1alpha, ``sidecar.reflection``), and listens in plaintext or with TLS (mutual TLS
when a client CA is given).
"""

from __future__ import annotations

from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from engine.config import ConfigError
from sidecar._proto.chainkv.v1 import sidecar_pb2 as pb
from sidecar.options import ServerOptions
from sidecar.reflection import enable_reflection

SERVICE = pb.DESCRIPTOR.services_by_name["Sidecar"].full_name  # "chainkv.v1.Sidecar"
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def server_credentials(options: ServerOptions) -> grpc.ServerCredentials | None:
    """TLS credentials from the options' PEM files; None for plaintext."""
    o = options
    if not (o.tls_cert or o.tls_key):
        return None
    if not (o.tls_cert and o.tls_key):
        raise ConfigError("TLS needs both a certificate and a key")
    ca = Path(o.tls_client_ca).read_bytes() if o.tls_client_ca else None
    return grpc.ssl_server_credentials(
        [(Path(o.tls_key).read_bytes(), Path(o.tls_cert).read_bytes())],
        root_certificates=ca,
        require_client_auth=ca is not None,
    )


class GrpcEndpoint:
    def __init__(self, options: ServerOptions):
        self.options = options
        self.health = health.aio.HealthServicer()
        self.port: int | None = None
        self._server: grpc.aio.Server | None = None

    async def start(self, handlers: grpc.GenericRpcHandler) -> int:
        """Listen with ``handlers`` beside health and reflection; returns the port (SERVING)."""
        o = self.options
        server = grpc.aio.server(
            options=[
                ("grpc.max_receive_message_length", o.max_message_bytes),
                ("grpc.max_send_message_length", o.max_message_bytes),
                ("grpc.so_reuseport", 0),
            ]
        )
        server.add_generic_rpc_handlers((handlers,))
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        enable_reflection([SERVICE, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name], server)
        address = f"{o.host}:{o.port}"
        creds = server_credentials(o)
        port = server.add_secure_port(address, creds) if creds is not None else server.add_insecure_port(address)
        if not port:
            raise ConfigError(f"cannot listen on {address}")
        await server.start()
        self._server, self.port = server, port
        await self.set_health(SERVING)
        return port

    async def set_health(self, status) -> None:
        for name in ("", SERVICE):
            await self.health.set(name, status)

    async def stop(self, grace: float) -> None:
        """Stop accepting calls; running ones get ``grace`` seconds."""
        if self._server is not None:
            await self._server.stop(grace)
            self._server = None
