"""``chainkv serve`` as a subprocess on a free port: start, wait until it serves, SIGKILL, restart."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from sidecar._proto.chainkv.v1 import sidecar_pb2 as pb
from sidecar._proto.chainkv.v1 import sidecar_pb2_grpc

ROOT = Path(__file__).resolve().parents[2]
TOKENS = {"tok-alpha": "alpha"}
ALPHA = [("authorization", "Bearer tok-alpha")]


class Sidecar:
    def __init__(self, store_url: str, *extra: str):
        self.store_url, self.extra = store_url, list(extra)
        self.proc: subprocess.Popen | None = None

    def start(self) -> "Sidecar":
        cmd = [sys.executable, "-m", "sidecar.cli", "serve", "--port", "0", "--store", self.store_url, "--device", "cpu",
               "--num-pages", "3000", "--prefill-chunk-size", "128", "--max-model-len", "1024", "--grace-s", "5",
               "--log-level", "WARNING", *self.extra]
        for token, tenant in TOKENS.items():
            cmd += ["--auth-token", f"{token}={tenant}"]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
                   OMP_NUM_THREADS="1")
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.output: list[str] = []
        self.port: int | None = None
        self.metrics_port: int | None = None
        self._ready = threading.Event()
        threading.Thread(target=self._read, args=(self.proc,), daemon=True).start()
        return self

    def _read(self, proc) -> None:
        for line in proc.stdout:
            self.output.append(line)
            if line.startswith("chainkv: metrics on http://"):
                self.metrics_port = int(line.rsplit(":", 1)[1].split("/")[0])
            if "serving chainkv.v1.Sidecar on" in line:
                self.port = int(line.split(" on ", 1)[1].split()[0].rsplit(":", 1)[1])
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
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for fam in text_string_to_metric_families(text) for s in fam.samples}

    def serving(self) -> bool:
        h = health_pb2_grpc.HealthStub(self.channel).Check(health_pb2.HealthCheckRequest(service="chainkv.v1.Sidecar"),
                                                           timeout=10)
        return h.status == health_pb2.HealthCheckResponse.SERVING

    def kill(self) -> int:
        if self.proc.poll() is None:
            self.proc.kill()
        rc = self.proc.wait(30)
        self.channel.close()
        return rc

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)


def request(session: str, turn: list[tuple[str, str]], request_id: str = "", **kw) -> pb.TurnRequest:
    kw.setdefault("max_tokens", 8)
    return pb.TurnRequest(session_id=session, request_id=request_id,
                          messages=[pb.Message(role=r, content=c) for r, c in turn], **kw)


def run(stub, req, metadata=ALPHA, **kw) -> pb.TurnCompletion:
    events = list(stub.Turn(req, metadata=metadata, **kw))
    assert events[-1].WhichOneof("event") == "completion"
    return events[-1].completion
