"""The gRPC endpoint: the grpc.aio server with its message limits, TLS, health and reflection.

``GrpcEndpoint`` owns the listening side of the sidecar and nothing else: it adds the servicer's
handlers, the standard health service (``grpc.health.v1``, reported for "" and
``chainkv.v1.Sidecar``) and server reflection (v1 and v1alpha, ``sidecar.grpc.reflection``), and
listens in plaintext or with TLS (mutual TLS when a client CA is given).
"""

from __future__ import annotations

import re
import ssl
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from engine.config import ConfigError
from sidecar._proto.chainkv.v1 import sidecar_pb2 as pb
from sidecar.grpc.options import ServerOptions
from sidecar.grpc.reflection import enable_reflection

SERVICE = pb.DESCRIPTOR.services_by_name["Sidecar"].full_name  # "chainkv.v1.Sidecar"
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def check_tls_files(options: ServerOptions) -> None:
    """Raise ConfigError (one line) unless the options' TLS files are readable PEM: a certificate
    chain and its own private key, and a CA file if one is given (grpc would only fail to bind)."""
    o = options
    if not (o.tls_cert or o.tls_key or o.tls_client_ca):
        return
    if not (o.tls_cert and o.tls_key):
        raise ConfigError("TLS needs both a certificate (--tls-cert) and a key (--tls-key)")
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        ctx.load_cert_chain(o.tls_cert, o.tls_key, password=lambda: b"")  # never a prompt for a passphrase
    except OSError as e:  # ssl.SSLError is an OSError too
        raise ConfigError(
            f"--tls-cert {o.tls_cert} / --tls-key {o.tls_key}: {_tls_reason(e, 'a PEM certificate chain and its private key')}"
        ) from None
    if o.tls_client_ca:
        try:
            ctx.load_verify_locations(o.tls_client_ca)
        except OSError as e:
            raise ConfigError(f"--tls-client-ca {o.tls_client_ca}: {_tls_reason(e, 'a PEM CA certificate')}") from None


def _tls_reason(e: OSError, expected: str) -> str:
    """One line on why ``ssl`` refused a file (its source location dropped)."""
    if not isinstance(e, ssl.SSLError):
        return e.strerror or str(e)
    detail = re.sub(r"\s*\(_ssl\.c:\d+\)", "", str(e.args[1]) if len(e.args) > 1 else str(e))
    return f"not {expected} ({detail})"


def server_credentials(options: ServerOptions) -> grpc.ServerCredentials | None:
    """TLS credentials from the options' PEM files; None for plaintext."""
    o = options
    if not (o.tls_cert or o.tls_key):
        return None
    check_tls_files(o)
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
        try:
            port = server.add_secure_port(address, creds) if creds is not None else server.add_insecure_port(address)
        except RuntimeError:  # grpc's "Failed to bind"
            port = 0
        if not port:
            raise ConfigError(f"--port: cannot listen on {address}")
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
