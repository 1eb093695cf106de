"""What ``--durability sync`` costs: time to first token and turn latency, async vs sync.

    python benchmarks/durability.py                        # SmolLM2 on the CPU, a redis-server it starts (AOF, fsync always)
    python benchmarks/durability.py --store /tmp/sessions  # the directory store instead

One in-process sidecar per mode, the same conversations (``--sessions`` at once, ``--turns`` each, greedy,
``--max-tokens``), measured at the client: TTFT is the first streamed delta, latency the completion.
With sync the completion waits for the snapshot commit; the deltas do not. Writes
benchmarks/results/durability_cpu.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

OUT = ROOT / "benchmarks" / "results" / "durability_cpu.json"
QUESTIONS = [
    "Name three fruits.",
    "Which of them is yellow?",
    "Name one more fruit.",
    "Thanks. Which is sweetest?",
    "And the most sour?",
    "Say goodbye.",
]


def start_redis(folder: str) -> tuple[subprocess.Popen, str]:
    if shutil.which("redis-server") is None:
        raise SystemExit("redis-server is not installed; pass --store PATH for the directory store")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [
            "redis-server",
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--dir",
            folder,
            "--appendonly",
            "yes",
            "--appendfsync",
            "always",
            "--save",
            "",
            "--loglevel",
            "warning",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.STDOUT,
    )
    import redis

    client = redis.Redis(port=port)
    for _ in range(200):
        try:
            client.ping()
            break
        except redis.exceptions.ConnectionError:
            time.sleep(0.05)
    return proc, f"redis://127.0.0.1:{port}/0"


def run_mode(engine, store_url: str, mode: str, sessions: int, turns: int, max_tokens: int) -> dict:
    import grpc

    from sidecar._proto.chainkv.v1 import sidecar_pb2 as pb
    from sidecar._proto.chainkv.v1 import sidecar_pb2_grpc
    from sidecar.grpc.server import ServerOptions, ServerThread
    from sidecar.store import open_store

    srv = ServerThread(engine, ServerOptions(port=0, durability=mode), open_store(store_url))
    port = srv.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    stub = sidecar_pb2_grpc.SidecarStub(channel)
    ttft, latency = [], []
    lock = threading.Lock()

    def conversation(i: int) -> None:
        sid = f"{mode}-{i}-{time.monotonic_ns()}"
        for t in range(turns):
            req = pb.TurnRequest(
                session_id=sid,
                request_id=f"r{t}",
                expected_turn_index=t,
                max_tokens=max_tokens,
                messages=[pb.Message(role="user", content=QUESTIONS[t % len(QUESTIONS)])],
            )
            t0 = time.perf_counter()
            first = None
            for event in stub.Turn(req):
                if first is None and event.WhichOneof("event") == "delta":
                    first = time.perf_counter() - t0
            done = time.perf_counter() - t0
            if t:  # the first turn of each session includes its prefill of the template: keep it out
                with lock:
                    ttft.append(first if first is not None else done)
                    latency.append(done)

    threads = [threading.Thread(target=conversation, args=(i,)) for i in range(sessions)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    channel.close()
    writes = srv.server.writer.writes if srv.server.writer else 0
    srv.stop(grace=5)
    for sid in list(engine.chains.chains):
        engine.end_session(sid)

    def pct(xs, q):
        xs = sorted(xs)
        return xs[min(len(xs) - 1, int(q * len(xs)))]

    return {
        "durability": mode,
        "turns_measured": len(latency),
        "snapshot_writes": writes,
        "ttft_p50_s": statistics.median(ttft),
        "ttft_p95_s": pct(ttft, 0.95),
        "turn_latency_p50_s": statistics.median(latency),
        "turn_latency_p95_s": pct(latency, 0.95),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--store", default=None, help="a store URL or folder (default: a redis-server started here)")
    p.add_argument("--sessions", type=int, default=4)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--out", default=str(OUT))
    args = p.parse_args(argv)

    from engine.config import EngineConfig
    from engine.llm import LLMEngine

    engine = LLMEngine(EngineConfig(device="cpu", num_pages=4000, max_model_len=2048, prefill_chunk_size=256))
    tmp = tempfile.mkdtemp(prefix="chainkv-durability-")
    redis_proc = None
    store = args.store
    if store is None:
        redis_proc, store = start_redis(tmp)
    try:
        rows = [run_mode(engine, store, mode, args.sessions, args.turns, args.max_tokens) for mode in ("async", "sync")]
    finally:
        if redis_proc is not None:
            redis_proc.terminate()
            redis_proc.wait(10)
        shutil.rmtree(tmp, ignore_errors=True)
    a, s = rows
    out = {
        "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": f"{platform.machine()} {platform.system()}, CPU",
        "model": engine.model_dir.name,
        "store": "redis (AOF, appendfsync always)" if args.store is None else args.store,
        "sessions": args.sessions,
        "turns": args.turns,
        "max_tokens": args.max_tokens,
        "command": "python benchmarks/durability.py" + ("" if args.store is None else f" --store {args.store}"),
        "rows": rows,
        "sync_vs_async": {
            "ttft_p50": s["ttft_p50_s"] / a["ttft_p50_s"],
            "turn_latency_p50": s["turn_latency_p50_s"] / a["turn_latency_p50_s"],
            "turn_latency_p50_added_s": s["turn_latency_p50_s"] - a["turn_latency_p50_s"],
        },
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
