"""The sidecar over TLS (a self-signed certificate made with openssl), with auth and no store."""

from __future__ import annotations

import shutil
import subprocess

import grpc
import pytest

from sidecar._proto.chainkv.v1 import sidecar_pb2 as pb
from sidecar._proto.chainkv.v1 import sidecar_pb2_grpc

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cert(tmp_path_factory):
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    d = tmp_path_factory.mktemp("tls")
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            str(d / "key.pem"),
            "-out",
            str(d / "cert.pem"),
            "-days",
            "1",
            "-subj",
            "/CN=localhost",
            "-addext",
            "subjectAltName=DNS:localhost,IP:127.0.0.1",
        ],
        check=True,
        capture_output=True,
    )
    return d / "cert.pem", d / "key.pem"


def test_tls_auth_and_no_store(smol_engine, cert):
    from sidecar.grpc.auth import Authenticator
    from sidecar.grpc.server import ServerOptions, ServerThread

    cert_file, key_file = cert
    options = ServerOptions(port=0, tls_cert=str(cert_file), tls_key=str(key_file), auth=Authenticator({"t0k": "acme"}))
    server = ServerThread(smol_engine, options, store=None)
    port = server.start()
    try:
        creds = grpc.ssl_channel_credentials(cert_file.read_bytes())
        with grpc.secure_channel(f"localhost:{port}", creds) as ch:
            stub = sidecar_pb2_grpc.SidecarStub(ch)
            auth = [("authorization", "Bearer t0k")]
            req = pb.TurnRequest(session_id="tls", messages=[pb.Message(role="user", content="Hi!")], max_tokens=3)
            done = list(stub.Turn(req, metadata=auth))[-1].completion
            assert done.usage.generated_tokens >= 1 and done.usage.source_tier == pb.TIER_NEW
            info = stub.GetSession(pb.GetSessionRequest(session_id="tls"), metadata=auth)
            assert info.turn_index == 1 and info.snapshot_state == pb.SNAPSHOT_STATE_UNSPECIFIED  # no store
            with pytest.raises(grpc.RpcError) as e:  # nothing to resume from without a store
                stub.Resume(pb.ResumeRequest(session_id="elsewhere"), metadata=auth)
            assert e.value.code() == grpc.StatusCode.NOT_FOUND
            assert stub.EndSession(pb.EndSessionRequest(session_id="tls"), metadata=auth).ended_here
        with grpc.insecure_channel(f"127.0.0.1:{port}") as plain:  # plaintext is refused
            with pytest.raises(grpc.RpcError) as e:
                pb_stub = sidecar_pb2_grpc.SidecarStub(plain)
                pb_stub.GetSession(
                    pb.GetSessionRequest(session_id="tls"), metadata=[("authorization", "Bearer t0k")], timeout=5
                )
            assert e.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
    finally:
        server.stop(grace=1)
