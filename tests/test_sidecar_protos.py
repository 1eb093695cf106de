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


def test_the_method_settings_are_spelled_the_way_method_spec_declares_them():
    """``MethodSpec``'s fields are EngineConfig's method fields (same defaults), the gRPC Turn's and
    Session's method fields, and what the sidecar reads from and writes into them, round trip."""
    import dataclasses

    from engine.api import MethodSpec
    from engine.config import EngineConfig
    from sidecar._proto.chainkv.v1 import sidecar_pb2 as pb
    from sidecar.turns.protocol import (
        InvalidRequest,
        method_fields,
        method_spec,
        request_method_fields,
        set_method_fields,
    )
    from sidecar.turns.request import TurnRequest, from_proto

    config = {f.name: f for f in dataclasses.fields(EngineConfig)}
    for f in dataclasses.fields(MethodSpec):
        assert f.name in config, f"EngineConfig lacks the method setting {f.name}"
        default = f.default_factory() if f.default is dataclasses.MISSING else f.default
        ours = config[f.name]
        assert default == (ours.default_factory() if ours.default is dataclasses.MISSING else ours.default)
    for message in (pb.TurnRequest, pb.Session):
        assert set(MethodSpec.field_names()) <= set(message.DESCRIPTOR.fields_by_name)
    spec = MethodSpec("streaming_llm", budget=8, method_args={"n_sink": "2"})
    assert MethodSpec.from_config(EngineConfig(method="streaming_llm", budget=8, method_args={"n_sink": "2"})) == spec
    assert MethodSpec.from_record(spec.to_record()) == spec
    assert set(MethodSpec.field_names()) <= {f.name for f in dataclasses.fields(TurnRequest)}
    req = pb.TurnRequest()
    assert method_spec(from_proto(req)) is None and method_fields(req) == {
        "method": "",
        "budget": None,
        "budget_ratio": None,
        "method_args": {},
    }
    assert request_method_fields(from_proto(req)) == method_fields(req)
    set_method_fields(req, spec)
    assert method_spec(from_proto(req)) == spec
    assert request_method_fields(from_proto(req)) == method_fields(req) == spec.to_record()
    session = pb.Session()
    set_method_fields(session, MethodSpec("snapkv", budget_ratio=0.5))
    assert method_fields(session) == {"method": "snapkv", "budget": None, "budget_ratio": 0.5, "method_args": {}}
    with pytest.raises(InvalidRequest, match="^budget, budget_ratio and method_args need a method$"):
        method_spec(from_proto(pb.TurnRequest(budget=0)))
