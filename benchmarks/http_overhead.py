"""HTTP (OpenAI Chat Completions, streaming) vs gRPC (Turn) per turn, on one server and one engine.

    python benchmarks/http_overhead.py [--model smollm2] [--sessions 4] [--turns 4] [--out benchmarks/results/http_overhead.json]

Both fronts run the same conversations (a user message per turn, ``--max-tokens`` tokens out with
EOS ignored) on the same in-process sidecar: the gRPC stub's ``Turn`` against the official
``openai`` client's streaming ``chat.completions.create`` (its session named by
``prompt_cache_key``, so both continue their session and prefill only the new message). Sessions
alternate between the fronts so load drifts hit both alike. Reported per front: the client's time
to first token (request sent -> first text), the engine's own (``usage.time_to_first_token_s``
for gRPC; the same engine measure for HTTP, read from the session's usage) and the difference (what
the front adds), and the whole turn's latency, as medians over turns > 0 and over all turns.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()


def user_text(session: int, turn: int) -> str:
    return f"Turn {turn} of session {session}: " + " ".join(WORDS[(session + turn + i) % len(WORDS)] for i in range(40))


def run_grpc(stub, pb, session: int, turns: int, max_tokens: int) -> list[dict]:
    sid, rows = f"bench-grpc-{uuid.uuid4().hex[:8]}", []
    for t in range(turns):
        req = pb.TurnRequest(
            session_id=sid,
            messages=[pb.Message(role="user", content=user_text(session, t))],
            max_tokens=max_tokens,
            ignore_eos=True,
        )
        t0 = time.perf_counter()
        first = None
        for ev in stub.Turn(req, timeout=600):
            if first is None and ev.HasField("delta") and ev.delta.text:
                first = time.perf_counter() - t0
            if ev.HasField("completion"):
                usage = ev.completion.usage
        rows.append(
            {
                "turn": t,
                "ttft_client_s": first,
                "ttft_engine_s": usage.time_to_first_token_s,
                "latency_s": time.perf_counter() - t0,
                "reused": usage.reused_tokens,
            }
        )
    return rows


def run_http(client, model: str, engine_ttft, session: int, turns: int, max_tokens: int) -> list[dict]:
    key, msgs, rows = f"bench-http-{uuid.uuid4().hex[:8]}", [], []
    for t in range(turns):
        msgs.append({"role": "user", "content": user_text(session, t)})
        t0 = time.perf_counter()
        first, text, usage = None, "", None
        for ch in client.chat.completions.create(
            model=model,
            messages=msgs,
            max_tokens=max_tokens,
            stream=True,
            stream_options={"include_usage": True},
            prompt_cache_key=key,
            extra_body={"ignore_eos": True},
        ):
            if ch.usage is not None:
                usage = ch.usage
            elif ch.choices and ch.choices[0].delta.content:
                if first is None:
                    first = time.perf_counter() - t0
                text += ch.choices[0].delta.content
        rows.append(
            {
                "turn": t,
                "ttft_client_s": first,
                "ttft_engine_s": engine_ttft(),
                "latency_s": time.perf_counter() - t0,
                "reused": usage.prompt_tokens_details.cached_tokens,
            }
        )
        msgs.append({"role": "assistant", "content": text})
    return rows


def summarize(rows: list[dict]) -> dict:
    def med(key, later):
        vals = [r[key] for r in rows if r[key] is not None and (r["turn"] > 0 or not later)]
        return statistics.median(vals) if vals else None

    out = {}
    for later, tag in ((False, "all"), (True, "turns>0")):
        c, e = med("ttft_client_s", later), med("ttft_engine_s", later)
        out[tag] = {
            "ttft_client_ms": 1000 * c,
            "ttft_engine_ms": 1000 * e,
            "front_overhead_ms": 1000 * (c - e),
            "latency_ms": 1000 * med("latency_s", later),
        }
    out["turns"] = len(rows)
    out["reused_tokens_turns>0"] = statistics.median(r["reused"] for r in rows if r["turn"] > 0)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--sessions", type=int, default=4)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "http_overhead.json"))
    args = ap.parse_args()

    import grpc
    import openai
    import torch

    from engine.config import EngineConfig
    from engine.llm import LLMEngine
    from sidecar._proto.chainkv.v1 import sidecar_pb2 as pb
    from sidecar._proto.chainkv.v1 import sidecar_pb2_grpc
    from sidecar.http.app import HttpFront, HttpOptions
    from sidecar.grpc.server import ServerOptions, ServerThread

    engine = LLMEngine(EngineConfig(model=args.model, num_pages=20000, prefill_chunk_size=256))
    srv = ServerThread(engine, ServerOptions(port=0))
    port = srv.start()
    http = HttpFront(srv.server, HttpOptions(port=0))
    http_port = srv.run(http.start())
    stub = sidecar_pb2_grpc.SidecarStub(grpc.insecure_channel(f"127.0.0.1:{port}"))
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{http_port}/v1", api_key="x", max_retries=0, timeout=600)
    model = http.app.state.backend.model_name

    last = {}  # the engine's TTFT of the HTTP turn just run, taken from the engine's finished outputs
    hooks = srv.server.hooks
    on_turn = hooks.on_turn
    hooks.on_turn = lambda c, s: (last.__setitem__("ttft", c.usage.time_to_first_token_s), on_turn(c, s))

    run_grpc(stub, pb, 99, 2, args.max_tokens)  # warm up both paths
    run_http(client, model, lambda: last.get("ttft"), 99, 2, args.max_tokens)
    grpc_rows, http_rows = [], []
    for s in range(args.sessions):
        grpc_rows += run_grpc(stub, pb, s, args.turns, args.max_tokens)
        http_rows += run_http(client, model, lambda: last.get("ttft"), s, args.turns, args.max_tokens)
    result = {
        "benchmark": "http_overhead",
        "device": str(engine.device),
        "model": engine.model_dir.name,
        "torch_threads": torch.get_num_threads(),
        "sessions": args.sessions,
        "turns": args.turns,
        "max_tokens": args.max_tokens,
        "grpc": summarize(grpc_rows),
        "http": summarize(http_rows),
        "rows": {"grpc": grpc_rows, "http": http_rows},
    }
    srv.run(http.stop())
    srv.stop(grace=2)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    for front in ("grpc", "http"):
        r = result[front]["turns>0"]
        print(
            f"{front:5s} turns>0: TTFT client {r['ttft_client_ms']:.1f} ms, engine {r['ttft_engine_ms']:.1f} ms, "
            f"front overhead {r['front_overhead_ms']:.1f} ms, turn {r['latency_ms']:.1f} ms"
        )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
