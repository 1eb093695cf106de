"""``chainkv serve`` as a subprocess on a free port (start, wait until it serves, signal or SIGKILL, restart)
and the gRPC calls the process-level sidecar tests share: a turn request, a turn run to its completion,
waiting for a snapshot to commit, the health check. Used by tests/test_sidecar_server.py and
tests/reliability/test_faults.py."""

from __future__ import annotations

import os
import signal as signals
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from sidecar._proto.chainkv.v1 import sidecar_pb2 as pb
from sidecar._proto.chainkv.v1 import sidecar_pb2_grpc

ROOT = Path(__file__).resolve().parents[1]
TOKENS = {"tok-alpha": "alpha", "tok-beta": "beta"}
ALPHA = [("authorization", "Bearer tok-alpha")]
BETA = [("authorization", "Bearer tok-beta")]


class Sidecar:
    """``chainkv serve`` on SmolLM2 (CPU, ``--port 0``) against ``store_url``, with the ``TOKENS`` tenants.

    ``extra``: more serve flags; ``grace_s``: the drain grace on SIGTERM. ``start`` launches the process
    (again after a kill: a restart), ``wait_ready`` blocks until it logs its port (and, with
    ``--http-port``, its ``http_port``) and opens ``stub``."""

    def __init__(self, store_url: str, *extra: str, grace_s: float = 5, tokens: dict[str, str] = TOKENS):
        self.store_url, self.extra, self.grace_s = store_url, list(extra), grace_s
        self.tokens = dict(tokens)
        """Bearer token -> tenant, each an ``--auth-token``; empty: auth off."""
        self.proc: subprocess.Popen | None = None

    def start(self) -> "Sidecar":
        cmd = [
            sys.executable,
            "-m",
            "sidecar.cli",
            "serve",
            "--port",
            "0",
            "--store",
            self.store_url,
            "--device",
            "cpu",
            "--num-pages",
            "3000",
            "--prefill-chunk-size",
            "128",
            "--max-model-len",
            "1024",
            "--grace-s",
            str(self.grace_s),
            "--log-level",
            "WARNING",
            *self.extra,
        ]
        for token, tenant in self.tokens.items():
            cmd += ["--auth-token", f"{token}={tenant}"]
        env = dict(
            os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]), OMP_NUM_THREADS="1"
        )
        self.proc = subprocess.Popen(
            cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        self.output: list[str] = []
        self.port: int | None = None
        self.http_port: int | None = None
        self.metrics_port: int | None = None
        self.http_port: int | None = None
        """The HTTP front's port, when ``--http-port`` is among ``extra``."""
        self._ready = threading.Event()
        threading.Thread(target=self._read, args=(self.proc,), daemon=True).start()
        return self

    def _read(self, proc) -> None:
        for line in proc.stdout:
            self.output.append(line)
            if line.startswith("chainkv: metrics on http://"):
                self.metrics_port = int(line.rsplit(":", 1)[1].split("/")[0])
            if line.startswith("chainkv: serving the OpenAI-compatible HTTP API on http://"):
                self.http_port = int(line.split("http://", 1)[1].split("/", 1)[0].rsplit(":", 1)[1])
            if "serving chainkv.v1.Sidecar on" in line:
                self.port = int(line.split(" on ", 1)[1].split()[0].rsplit(":", 1)[1])
            if "OpenAI-compatible HTTP API on http://" in line:
                self.http_port = int(line.split("http://", 1)[1].split("/", 1)[0].rsplit(":", 1)[1])
            if self.port is not None and (self.http_port is not None or "--http-port" not in self.extra):
                self._ready.set()
        self._ready.set()

    def wait_ready(self, timeout: float = 300.0) -> "Sidecar":
        self._ready.wait(timeout)
        if self.port is None:
            raise RuntimeError("the sidecar did not start:\n" + "".join(self.output))
        self.channel = grpc.insecure_channel(f"127.0.0.1:{self.port}")
        self.stub = sidecar_pb2_grpc.SidecarStub(self.channel)
        return self

    def metrics(self) -> dict[tuple, float]:
        """The metrics endpoint's samples: (name, sorted labels) -> value."""
        import urllib.request

        from prometheus_client.parser import text_string_to_metric_families

        text = urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=10).read().decode()
        return {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text)
            for s in fam.samples
        }

    def serving(self) -> bool:
        return serving(self.channel, timeout=10)

    def signal(self, sig: int, timeout: float = 60.0) -> int:
        """Send ``sig`` (if the process still runs) and return its exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        return self.proc.wait(timeout)

    def kill(self) -> int:
        """SIGKILL; closes the channel; returns the exit code."""
        rc = self.signal(signals.SIGKILL, timeout=30)
        self.channel.close()
        return rc

    def stop(self) -> None:
        """Teardown: SIGKILL if it still runs."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)


def request(session: str, turn: list[tuple[str, str]], request_id: str = "", **kw) -> pb.TurnRequest:
    """A TurnRequest of ``turn``'s (role, content) messages; ``max_tokens`` 8 unless given."""
    kw.setdefault("max_tokens", 8)
    return pb.TurnRequest(
        session_id=session, request_id=request_id, messages=[pb.Message(role=r, content=c) for r, c in turn], **kw
    )


def turn_events(stub, req, metadata=ALPHA, **kw) -> tuple[list[pb.TurnEvent], pb.TurnCompletion]:
    """Run one Turn call to its end: every streamed event, and the completion (which must be the last)."""
    events = list(stub.Turn(req, metadata=metadata, **kw))
    assert events[-1].WhichOneof("event") == "completion"
    return events, events[-1].completion


def run(stub, req, metadata=ALPHA, **kw) -> pb.TurnCompletion:
    """Run one Turn call to its end and return its completion."""
    return turn_events(stub, req, metadata, **kw)[1]


def wait_for(predicate, timeout: float = 60.0, what: str = "condition"):
    """Poll ``predicate`` every 50 ms until it returns something truthy (returned); AssertionError after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def committed(stub, session: str, metadata=ALPHA) -> bool:
    """Whether ``session``'s latest generation is committed to the store."""
    s = stub.GetSession(pb.GetSessionRequest(session_id=session), metadata=metadata)
    return s.snapshot_state == pb.SNAPSHOT_STATE_COMMITTED and s.committed_generation == s.generation


def serving(channel, timeout: float | None = None) -> bool:
    """The standard gRPC health check of the Sidecar service answers SERVING."""
    h = health_pb2_grpc.HealthStub(channel).Check(
        health_pb2.HealthCheckRequest(service="chainkv.v1.Sidecar"), timeout=timeout
    )
    return h.status == health_pb2.HealthCheckResponse.SERVING
