"""The pool overlay's HAProxy config (deploy/k8s/overlays/pool/haproxy.cfg) run by the real ``haproxy``
on free local ports, its DNS-filled server slots replaced by static servers (no cluster DNS here),
with an admin socket to read each server's state (UP / DOWN) from."""

from __future__ import annotations

import re
import shutil
import socket
import subprocess
import threading
from dataclasses import dataclass
from pathlib import Path

from redis_server import free_port

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "deploy" / "k8s" / "overlays" / "pool" / "haproxy.cfg"


def haproxy_binary() -> str | None:
    return shutil.which("haproxy") or next((p for p in ("/usr/sbin/haproxy",) if Path(p).is_file()), None)


@dataclass(frozen=True)
class Replica:
    name: str
    """The server's name in both backends (what the ``x-chainkv-replica`` response header says)."""
    grpc_port: int
    http_port: int


def local_config(text: str, replicas: list[Replica], admin_socket: Path) -> str:
    """``text`` with each backend's ``server-template`` line replaced by one static server per replica
    (the gRPC backend's over h2c, both health-checked on the gRPC port) and an admin socket."""
    out = []
    for line in text.splitlines():
        stripped = line.strip()
        if stripped == "global":
            out += [line, f"  stats socket {admin_socket} mode 600 level admin"]
        elif stripped.startswith("server-template "):
            h2 = " proto h2" in stripped
            for r in replicas:
                port = r.grpc_port if h2 else r.http_port
                out.append(f"  server {r.name} 127.0.0.1:{port}{' proto h2' if h2 else ''} port {r.grpc_port}")
        else:
            out.append(line)
    return "\n".join(out) + "\n"


class HAProxy:
    """``haproxy -db`` on ``local_config(CONFIG)``; ``grpc_target`` / ``http_url`` are its two fronts."""

    def __init__(self, folder: Path, replicas: list[Replica]):
        self.folder = Path(folder)
        self.admin = self.folder / "admin.sock"
        self.config = self.folder / "haproxy.cfg"
        self.config.write_text(local_config(CONFIG.read_text(), replicas, self.admin))
        self.grpc_port, self.http_port = free_port(), free_port()
        self.log: list[str] = []
        self.proc: subprocess.Popen | None = None

    @property
    def grpc_target(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def start(self) -> "HAProxy":
        env = {
            "PATH": "/usr/sbin:/usr/bin:/sbin:/bin",
            "CHAINKV_PROXY_GRPC_BIND": self.grpc_target,
            "CHAINKV_PROXY_HTTP_BIND": f"127.0.0.1:{self.http_port}",
        }
        self.proc = subprocess.Popen(
            [haproxy_binary(), "-db", "-f", str(self.config)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        threading.Thread(target=self._read, daemon=True).start()
        return self

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.log.append(line)

    def states(self) -> dict[tuple[str, str], str]:
        """(backend, server) -> status (``UP``, ``DOWN``, ``UP 1/2``, ...) from ``show stat``; {} while
        the admin socket is not open yet."""
        try:
            with socket.socket(socket.AF_UNIX) as s:
                s.settimeout(5)
                s.connect(str(self.admin))
                s.sendall(b"show stat\n")
                data = b""
                while chunk := s.recv(65536):
                    data += chunk
        except OSError:
            return {}
        rows = [line.split(",") for line in data.decode().splitlines() if line and not line.startswith("#")]
        return {(r[0], r[1]): r[17] for r in rows if r[1] not in ("FRONTEND", "BACKEND")}

    def servers_are(self, name: str, status: str) -> bool:
        """Whether ``name`` has ``status`` (``UP`` / ``DOWN``) in every backend."""
        got = [v for (_, server), v in self.states().items() if server == name]
        return bool(got) and all(re.fullmatch(status, v) for v in got)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(30)
