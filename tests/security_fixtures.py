"""What the sidecar's security tests share (tests/test_sidecar_security*.py): the tenants' tokens
and metadata, the snapshot key, and waiting for a committed snapshot."""

from __future__ import annotations

import time

import grpc
import pytest

from sidecar._proto.chainkv.v1 import sidecar_pb2 as pb

C = grpc.StatusCode
KEY = b"k" * 32
TOKENS = {"tok-alpha": "alpha", "tok-beta": "beta"}
ALPHA = [("authorization", "Bearer tok-alpha")]
BETA = [("authorization", "Bearer tok-beta")]


def code_of(fn) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as e:
        fn()
    return e.value.code()


def committed(stub, sid, metadata=ALPHA):
    """Wait until the session's snapshot in the store holds its latest generation."""
    for _ in range(400):
        s = stub.GetSession(pb.GetSessionRequest(session_id=sid), metadata=metadata)
        if s.snapshot_state == pb.SNAPSHOT_STATE_COMMITTED and s.committed_generation == s.generation:
            return s
        time.sleep(0.05)
    raise AssertionError(f"the snapshot of {sid} was not committed")
