"""The checked-in gRPC stubs are what grpcio-tools generates from proto/chainkv/v1/sidecar.proto."""

from __future__ import annotations

import filecmp

import pytest

from sidecar.protogen import STUB_DIR, generate


def test_checked_in_stubs_match_a_fresh_generation(tmp_path):
    pytest.importorskip("grpc_tools")
    fresh = generate(tmp_path)
    rel = sorted(str(p.relative_to(tmp_path)) for p in fresh)
    assert "chainkv/v1/sidecar_pb2_grpc.py" in rel
    checked_in = sorted(
        str(p.relative_to(STUB_DIR)) for p in STUB_DIR.rglob("*") if p.is_file() and "__pycache__" not in p.parts
    )
    assert checked_in == rel, "sidecar/_proto has files the generator does not make (or lacks some)"
    _, mismatch, errors = filecmp.cmpfiles(tmp_path, STUB_DIR, rel, shallow=False)
    assert not mismatch and not errors, f"stale stubs {mismatch}: run `python -m sidecar.protogen`"


def test_stubs_import_as_a_package_and_describe_the_service():
    from sidecar._proto.chainkv.v1 import sidecar_pb2, sidecar_pb2_grpc

    service = sidecar_pb2.DESCRIPTOR.services_by_name["Sidecar"]
    assert service.full_name == "chainkv.v1.Sidecar"
    assert [m.name for m in service.methods] == [
        "Turn",
        "Resume",
        "EndSession",
        "GetSession",
        "ForkSession",
        "PruneHistory",
        "GetServerInfo",
    ]
    assert service.methods_by_name["Turn"].server_streaming
    assert hasattr(sidecar_pb2_grpc, "SidecarStub")
