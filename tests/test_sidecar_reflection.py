"""gRPC server reflection v1 and v1alpha on the sidecar's endpoint (sidecar/grpc/reflection.py): both list
the services and describe the Sidecar service; v1 describes itself under its own package."""

from __future__ import annotations

import asyncio
import threading

import grpc
import pytest
from google.protobuf import descriptor_pb2
from grpc_reflection.v1alpha import reflection_pb2 as rpb
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from sidecar.grpc.endpoint import SERVICE, GrpcEndpoint
from sidecar.grpc.options import ServerOptions
from sidecar.grpc.reflection import ALPHA_SERVICE, V1_SERVICE


@pytest.fixture(scope="module")
def target():
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    endpoint = GrpcEndpoint(ServerOptions(host="127.0.0.1", port=0))
    port = asyncio.run_coroutine_threadsafe(
        endpoint.start(grpc.method_handlers_generic_handler(SERVICE, {})), loop
    ).result(60)
    yield f"127.0.0.1:{port}"
    asyncio.run_coroutine_threadsafe(endpoint.stop(0), loop).result(60)
    loop.call_soon_threadsafe(loop.stop)


def _ask(target: str, service: str, *requests: rpb.ServerReflectionRequest) -> list[rpb.ServerReflectionResponse]:
    with grpc.insecure_channel(target) as channel:
        call = channel.stream_stream(
            f"/{service}/ServerReflectionInfo",
            request_serializer=rpb.ServerReflectionRequest.SerializeToString,
            response_deserializer=rpb.ServerReflectionResponse.FromString,
        )
        return list(call(iter(requests), timeout=30))


def _file(response: rpb.ServerReflectionResponse) -> descriptor_pb2.FileDescriptorProto:
    assert not response.HasField("error_response"), response.error_response
    return descriptor_pb2.FileDescriptorProto.FromString(response.file_descriptor_response.file_descriptor_proto[0])


@pytest.mark.parametrize("service", [V1_SERVICE, ALPHA_SERVICE])
def test_reflection_lists_and_describes_the_services(target, service):
    listed, sidecar, v1 = _ask(
        target,
        service,
        rpb.ServerReflectionRequest(list_services=""),
        rpb.ServerReflectionRequest(file_containing_symbol=SERVICE),
        rpb.ServerReflectionRequest(file_containing_symbol=V1_SERVICE),
    )
    names = {s.name for s in listed.list_services_response.service}
    assert {SERVICE, "grpc.health.v1.Health", V1_SERVICE, ALPHA_SERVICE} <= names
    f = _file(sidecar)
    assert f.package == "chainkv.v1" and "Turn" in [m.name for m in f.service[0].method]
    f = _file(v1)
    assert f.package == "grpc.reflection.v1" and f.service[0].name == "ServerReflection"
    assert f.service[0].method[0].input_type == ".grpc.reflection.v1.ServerReflectionRequest"
    assert all("v1alpha" not in fld.type_name for m in f.message_type for fld in m.field)


def test_a_v1_error_reply_and_the_v1alpha_descriptor_database(target):
    (missing,) = _ask(target, V1_SERVICE, rpb.ServerReflectionRequest(file_containing_symbol="no.such.Thing"))
    assert missing.error_response.error_code == grpc.StatusCode.NOT_FOUND.value[0]
    with grpc.insecure_channel(target) as channel:
        db = ProtoReflectionDescriptorDatabase(channel)
        assert SERVICE in db.get_services()
        assert db.FindFileContainingSymbol(SERVICE).package == "chainkv.v1"
