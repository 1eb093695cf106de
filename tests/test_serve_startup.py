"""Start-up checks of ``chainkv serve`` and a store that comes and goes (issue 30).

Before the model loads, an unreachable store, a port in use (gRPC, ``--http-port``,
``--metrics-port``, or two flags naming one port) and a TLS file that is not PEM each give one line
on stderr and exit code 2 (before: "serving", then exit 3 or a traceback, or serving while every
turn failed). While the server runs, a store that goes away turns gRPC health NOT_SERVING (HTTP
``/health`` 503), the requests that need it fail with UNAVAILABLE / 503 and are logged once a
minute without a traceback, and health is SERVING again once the store is back;
``--allow-store-down`` starts NOT_SERVING and turns SERVING when the store answers. Real
redis-server processes, stopped and started again on their port.
"""

from __future__ import annotations

import logging
import socket
import subprocess
import sys
import time

import grpc
import httpx
import pytest

from redis_server import RedisProcess, free_port
from sidecar._proto.chainkv.v1 import sidecar_pb2 as pb
from sidecar._proto.chainkv.v1 import sidecar_pb2_grpc
from tests.conftest import make_engine
from tests.sidecar_proc import ALPHA, TOKENS, Sidecar, request, run, serving, wait_for
from tests.test_security_cli import chainkv, one_line_error

pytestmark = pytest.mark.slow

C = grpc.StatusCode


@pytest.fixture
def stopped_redis(tmp_path):
    """A redis-server that ran on its port and was stopped (``start()`` brings it back there)."""
    folder = tmp_path / "redis"
    folder.mkdir()
    proc = RedisProcess(folder).start()
    proc.stop()
    yield proc
    proc.stop()


def listening() -> socket.socket:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    return sock


def test_an_unreachable_store_is_one_line_and_exit_2(stopped_redis):
    r = chainkv("serve", "--port", "0", "--store", stopped_redis.url)
    one_line_error(r, f"127.0.0.1:{stopped_redis.port}", "cannot be reached", "--allow-store-down")
    assert "serving" not in r.stdout


@pytest.mark.parametrize("flag", ["--http-port", "--metrics-port"])
def test_a_busy_http_or_metrics_port_is_one_line_and_exit_2(flag):
    with listening() as busy:
        port = busy.getsockname()[1]
        r = chainkv("serve", "--port", "0", "--store", "none", flag, str(port))
    one_line_error(r, flag, f"127.0.0.1:{port}")
    assert "serving" not in r.stdout


def test_two_flags_naming_one_port_are_one_line_and_exit_2():
    port = str(free_port())
    one_line_error(chainkv("serve", "--port", port, "--http-port", port, "--store", "none"), "--http-port", "--port")


@pytest.mark.parametrize("which", ["garbage", "missing key"])
def test_a_bad_tls_file_is_one_line_and_exit_2(tmp_path, which):
    cert = tmp_path / "cert.pem"
    cert.write_text("not a certificate\n")
    key = tmp_path / ("nope.pem" if which == "missing key" else "cert.pem")
    r = chainkv("serve", "--port", "0", "--store", "none", "--tls-cert", str(cert), "--tls-key", str(key))
    one_line_error(r, "--tls-cert", str(cert))
    assert "serving" not in r.stdout


def test_serve_help_shows_every_default_and_whole_texts():
    out = subprocess.run(
        [sys.executable, "-m", "sidecar.cli", "serve", "--help"], capture_output=True, text=True, check=True
    ).stdout
    flat = " ".join(out.split())
    assert "_MISSING_TYPE" not in out and "object at 0x" not in out
    assert (
        "--prune-roles PRUNE_ROLES Roles of history spans that Prefix-Cache Pruning may shrink. (default: tool)" in flat
    )
    assert "(greedy CUDA-graph decoding); tokens reach the outputs one step later. (default: True)" in flat
    assert "--allow-store-down" in out


@pytest.fixture(scope="module")
def engine(tiny_chat_dir):
    return make_engine(tiny_chat_dir, num_pages=2000, prefill_chunk_size=128, max_model_len=2048)


def test_health_follows_the_store_and_its_errors_are_logged_once_a_minute(engine, stopped_redis, caplog):
    from sidecar.grpc.auth import Authenticator
    from sidecar.http.app import HttpFront, HttpOptions
    from sidecar.grpc.server import ServerOptions, ServerThread
    from sidecar.store import RedisStore

    caplog.set_level(logging.WARNING)
    redis = stopped_redis.start()
    server = ServerThread(
        engine, ServerOptions(port=0, auth=Authenticator(TOKENS), store_check_s=0.1), RedisStore(redis.url)
    )
    port = server.start()
    http = HttpFront(server.server, HttpOptions(port=0))
    url = f"http://127.0.0.1:{server.run(http.start())}"
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    stub = sidecar_pb2_grpc.SidecarStub(channel)
    try:
        assert serving(channel) and httpx.get(f"{url}/health", timeout=30).status_code == 200
        assert run(stub, request("outage", [("user", "hi")], max_tokens=2)).turn_index == 0
        redis.stop()
        wait_for(lambda: not serving(channel), what="health NOT_SERVING")
        assert httpx.get(f"{url}/health", timeout=30).status_code == 503
        caplog.clear()
        t0 = time.monotonic()
        for i in range(4):  # each needs the store
            with pytest.raises(grpc.RpcError) as e:
                stub.Resume(pb.ResumeRequest(session_id=f"gone-{i}"), metadata=ALPHA)
            assert e.value.code() == C.UNAVAILABLE
            r = httpx.post(
                f"{url}/v1/chat/completions",
                json={
                    "model": http.app.state.backend.model_name,
                    "messages": [{"role": "user", "content": "hi"}],
                    "max_tokens": 2,
                },
                headers={"Authorization": "Bearer tok-alpha", "X-Session-Id": f"gone-{i}"},
                timeout=60,
            )
            assert r.status_code == 503, r.text
        minutes = int((time.monotonic() - t0) // 60) + 1
        failures = [rec for rec in caplog.records if "the session store is unavailable" in rec.getMessage()]
        assert not [rec for rec in caplog.records if rec.exc_info], "no traceback while the store is down"
        assert 1 <= len(failures) <= minutes, [rec.getMessage() for rec in failures]
        redis.start()
        wait_for(lambda: serving(channel), what="health SERVING again")
        assert httpx.get(f"{url}/health", timeout=30).status_code == 200
        assert run(stub, request("outage", [("user", "and now?")], max_tokens=2)).turn_index == 1
    finally:
        channel.close()
        server.run(http.stop())
        server.stop(grace=1)


def test_a_store_down_at_start_stops_it_unless_allowed_then_health_waits_for_it(engine, stopped_redis):
    from sidecar.grpc.server import ServerOptions, ServerThread
    from sidecar.store import RedisStore, StoreUnavailable

    with pytest.raises(StoreUnavailable, match="cannot be reached"):
        ServerThread(engine, ServerOptions(port=0), RedisStore(stopped_redis.url)).start()
    server = ServerThread(
        engine, ServerOptions(port=0, allow_store_down=True, store_check_s=0.1), RedisStore(stopped_redis.url)
    )
    channel = grpc.insecure_channel(f"127.0.0.1:{server.start()}")
    try:
        assert not serving(channel)
        stopped_redis.start()
        wait_for(lambda: serving(channel), what="health SERVING once the store answers")
        stub = sidecar_pb2_grpc.SidecarStub(channel)
        assert run(stub, request("late-store", [("user", "hi")], max_tokens=2), metadata=None).turn_index == 0
    finally:
        channel.close()
        server.stop(grace=1)


def test_serve_allow_store_down_announces_not_serving_and_serves_once_the_store_answers(stopped_redis):
    sidecar = Sidecar(stopped_redis.url, "--allow-store-down").start().wait_ready()
    try:
        assert "health NOT_SERVING until it does" in "".join(sidecar.output)
        assert not sidecar.serving()
        stopped_redis.start()
        wait_for(sidecar.serving, what="health SERVING once the store answers")
        assert run(sidecar.stub, request("cli-late-store", [("user", "hi")], max_tokens=2)).turn_index == 0
    finally:
        sidecar.stop()
