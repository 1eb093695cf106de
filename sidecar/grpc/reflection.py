"""gRPC server reflection, both versions: ``grpc.reflection.v1`` (what grpcurl, Postman and current
clients ask first) and ``grpc.reflection.v1alpha`` (older clients).

grpcio-reflection implements only v1alpha. v1 is the same protocol under another package: the same
messages with the same field numbers, so the bytes on the wire are identical. This module therefore
registers a v1 file descriptor derived from the library's v1alpha one (package and type names
renamed), so that v1 is listed and can itself be described, and serves the v1 method with the
library's servicer and message classes. When grpcio-reflection ships ``grpc_reflection.v1``, that is
used instead.
"""

from __future__ import annotations

from typing import Iterable

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool
from grpc_reflection.v1alpha import reflection
from grpc_reflection.v1alpha import reflection_pb2 as alpha

ALPHA_SERVICE = reflection.SERVICE_NAME  # "grpc.reflection.v1alpha.ServerReflection"
V1_SERVICE = "grpc.reflection.v1.ServerReflection"
_ALPHA_PKG, _V1_PKG = ".grpc.reflection.v1alpha.", ".grpc.reflection.v1."


def _v1_file() -> descriptor_pb2.FileDescriptorProto:
    """The v1 reflection.proto: the v1alpha descriptor with its package renamed."""
    fdp = descriptor_pb2.FileDescriptorProto()
    alpha.DESCRIPTOR.CopyToProto(fdp)
    fdp.name = "grpc/reflection/v1/reflection.proto"
    fdp.package = "grpc.reflection.v1"
    fdp.options.java_package = "io.grpc.reflection.v1"
    fdp.options.go_package = "google.golang.org/grpc/reflection/grpc_reflection_v1"
    for msg in fdp.message_type:
        for field in msg.field:
            if field.type_name:
                field.type_name = field.type_name.replace(_ALPHA_PKG, _V1_PKG)
    for svc in fdp.service:
        for m in svc.method:
            m.input_type = m.input_type.replace(_ALPHA_PKG, _V1_PKG)
            m.output_type = m.output_type.replace(_ALPHA_PKG, _V1_PKG)
    return fdp


def _register_v1(pool: descriptor_pool.DescriptorPool) -> None:
    try:
        pool.FindServiceByName(V1_SERVICE)
    except KeyError:
        pool.AddSerializedFile(_v1_file().SerializeToString())


def _v1_handler(servicer) -> grpc.GenericRpcHandler:
    method = grpc.stream_stream_rpc_method_handler(
        servicer.ServerReflectionInfo,
        request_deserializer=alpha.ServerReflectionRequest.FromString,
        response_serializer=alpha.ServerReflectionResponse.SerializeToString,
    )
    return grpc.method_handlers_generic_handler(V1_SERVICE, {"ServerReflectionInfo": method})


def enable_reflection(service_names: Iterable[str], server: grpc.aio.Server) -> None:
    """Serve reflection v1 and v1alpha on ``server`` for ``service_names`` (both reflection services
    are added to the list)."""
    try:  # a grpcio-reflection that implements v1 itself
        from grpc_reflection.v1 import reflection as v1  # type: ignore[import-not-found]
    except ImportError:
        v1 = None
    names = [*service_names, ALPHA_SERVICE, V1_SERVICE]
    reflection.enable_server_reflection(names, server)
    if v1 is not None:
        v1.enable_server_reflection(names, server)
        return
    _register_v1(descriptor_pool.Default())
    server.add_generic_rpc_handlers((_v1_handler(reflection.aio.ReflectionServicer(names)),))


__all__ = ["ALPHA_SERVICE", "V1_SERVICE", "enable_reflection"]
