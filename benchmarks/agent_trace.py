"""Agent-shaped traffic over gRPC: what the chain cache is worth on multi-turn, tool-heavy sessions.

A synthetic trace: ``--sessions`` agent runs of ``--turns`` turns each. Every session starts with
the same long system prompt (instructions and tool descriptions, shared by all sessions) and its
own task; every later turn sends one tool result whose length is lognormal (median
``--tool-median`` words, ``--tool-sigma``), after a think time (exponential, mean ``--think-s``:
the agent running its tool). Replies are ``--output-tokens`` long (EOS ignored, greedy). The
trace is replayed through ``agent_adapters.client.AsyncChainKVClient`` at ``--concurrency``
sessions at a time, once per configuration (``--configs``, comma-separated):

  nochain          dense attention, no session reuse: every turn is a new session holding the whole
                   transcript so far (re-prefilled; the shared system prompt still comes from the
                   prefix cache), ended after the turn - a stateless server
  dense            dense attention on the chain cache: one session per run, only new messages sent
  METHOD           a sparse method on the chain cache (snapkv, quest, ...; ``--method-budget`` tokens per head)
  CONFIG+prune     the same with Prefix-Cache Pruning of old tool output: after each turn a
                   PruneHistory drops the KV of tool spans at least ``--tool-prune-lag`` turns old
  METHOD+recall    the method's ``+recall`` variant: what it evicts stays recallable in host memory
                   (engine/recall.py); combines with +prune
  CONFIG+hints     the same sending agent hints as an agent framework would (benchmarks/agent_hints.py):
                   a priority, a pin while each tool runs, a release with the last turn; ``--hints``
                   adds a +hints twin of every chain configuration, so both run side by side

A method the sidecar does not know (GetServerInfo lists them) is skipped with a message.
Per configuration: time to first token per turn (client side, by turn index), time per output
token, job completion time (a session's wall time, think time included) and busy time (the sum
of its turn latencies), and tokens prefilled / reused / pruned / generated. ``speedup`` is
nochain's mean busy time over the configuration's (think time is the agent's, not the server's);
``makespan_speedup`` compares the whole replay's wall time. Each turn also carries the engine's
timing record (Usage.timing: waiting, swap-in, recompute, prefill, decode, decode stalled behind
prefill), and with ``+recall`` the recall tier's copies (Usage.recall: bytes to and from the host,
cold pages fetched), which the summary totals per configuration. After the replay, with the
in-process sidecar, the engine's own rates are measured and each configuration gets a lower bound
on its makespan and makespan / bound (benchmarks/makespan_bound.py); a configuration that recalls
also gets its copies' time at the measured host <-> device bandwidth.

The sidecar is in-process (built from the engine flags, the same names as ``chainkv serve``) or an
existing one (``--target HOST:PORT``). Random weights with real shapes for GPU runs:
``--random-weights llama-3.1-8b --tokenizer benchmarks/.tokenizer`` (the tokenizer folder is made
by ``--prep-tokenizer`` from the local SmolLM2 conversion; the model gets its vocabulary size).

    python benchmarks/agent_trace.py --device cpu --num-pages 40000 --max-model-len 8192 \
        --prefill-chunk-size 512 --out benchmarks/results/agent_trace_cpu.json   # the CPU run (SmolLM2)
    python benchmarks/agent_trace.py --device cpu --num-pages 40000 --max-model-len 8192 \
        --prefill-chunk-size 512 --configs dense,snapkv --hints \
        --out benchmarks/results/agent_trace_cpu_hints.json                     # with and without hints
    benchmarks/agent_trace_gpu.sh          # the H200 run (see its header)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import shutil
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from agent_adapters.client import AsyncChainKVClient  # noqa: E402
from agent_adapters.messages import TextDelta, TurnResult  # noqa: E402
from benchmarks.agent_hints import HintPolicy, send_turn  # noqa: E402
from benchmarks.agent_trace_summary import recall_bandwidth, summarize  # noqa: E402
from benchmarks.serving_profile import ServingProfile, print_report  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from sidecar._proto.chainkv.v1 import sidecar_pb2 as pb  # noqa: E402

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")
WORDS = (
    "data value result query table index record field status error output item list page user file time "
    "name type size count total range start end node path key text line code test run step time cache "
    "load save read write open close find match sort merge split join parse check build send fetch"
).split()
SYSTEM_HEAD = (
    "You are an autonomous research agent. Work step by step. Call one tool per turn and read its "
    "output carefully before the next step. Tools: search(query) returns web results; "
    "read(url) returns a page; python(code) runs code and returns stdout. "
)


@dataclass
class TraceParams:
    sessions: int = 2
    turns: int = 6
    system_words: int = 300
    task_words: int = 40
    tool_median: int = 250
    tool_sigma: float = 0.6
    tool_min: int = 16
    tool_max: int = 1200
    output_tokens: int = 8
    think_s: float = 0.1
    trace_seed: int = 0


def _words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def make_trace(p: TraceParams) -> tuple[list[list[list[dict]]], list[list[float]]]:
    """Per session, per turn: the new messages; and the think time before each turn."""
    rng = random.Random(p.trace_seed)
    system = SYSTEM_HEAD + _words(random.Random(-1), p.system_words)  # one prompt shared by every session
    sessions, thinks = [], []
    for s in range(p.sessions):
        turns = [
            [
                {"role": "system", "content": system},
                {"role": "user", "content": f"Task {s}: " + _words(rng, p.task_words)},
            ]
        ]
        think = [0.0]
        for _ in range(1, p.turns):
            n = int(min(p.tool_max, max(p.tool_min, rng.lognormvariate(math.log(p.tool_median), p.tool_sigma))))
            turns.append([{"role": "tool", "name": "search", "content": _words(rng, n)}])
            think.append(rng.expovariate(1 / p.think_s) if p.think_s > 0 else 0.0)
        sessions.append(turns)
        thinks.append(think)
    return sessions, thinks


@dataclass
class Config:
    name: str
    chain: bool
    method: str
    prune: bool
    hints: bool = False

    @classmethod
    def parse(cls, name: str) -> "Config":
        base, *extras = name.split("+")
        if any(e not in ("prune", "recall", "hints") for e in extras) or len(set(extras)) < len(extras):
            raise SystemExit(f"unknown configuration suffix in {name!r} (+recall, +prune, +hints)")
        if base == "nochain":
            if extras:
                raise SystemExit("nochain has no session to prune, recall or send hints for")
            return cls(name, False, "dense", False)
        method = base + ("+recall" if "recall" in extras else "")
        return cls(name, True, method, "prune" in extras, "hints" in extras)


def config_names(configs: str, hints: bool) -> list[str]:
    """The configurations of ``--configs``; with ``hints``, each chain configuration followed by its
    ``+hints`` twin (side by side in one run)."""
    names = [c.strip() for c in configs.split(",") if c.strip()]
    if not hints:
        return names
    out = []
    for n in names:
        out.append(n)
        if n != "nochain" and "hints" not in n.split("+") and n + "+hints" not in names:
            out.append(n + "+hints")
    return out


async def one_turn(client: AsyncChainKVClient, session_id: str, messages: list[dict], opts: dict) -> dict:
    t0 = time.perf_counter()
    t_first = None
    result: TurnResult | None = None
    async for event in client.stream_turn(session_id, messages, **opts):
        if isinstance(event, TextDelta) and t_first is None:
            t_first = time.perf_counter()
        elif isinstance(event, TurnResult):
            result = event
    t1 = time.perf_counter()
    u = result.usage
    t_first = t_first or t1
    return {
        "ttft_s": t_first - t0,
        "server_ttft_s": u.time_to_first_token_s,
        "latency_s": t1 - t0,
        "tpot_s": (t1 - t_first) / max(1, u.generated_tokens - 1),
        "prompt_tokens": u.prompt_tokens,
        "reused_tokens": u.reused_tokens,
        "prefilled_tokens": u.prefilled_tokens,
        "pruned_tokens": u.pruned_tokens,
        "generated_tokens": u.generated_tokens,
        "history_tokens": u.history_tokens,
        "kv_tokens": u.kv_tokens,
        "source_tier": u.source_tier,
        "timing": dict(u.timing),
        "recall": dict(u.recall),
        "text": result.text,
    }


async def run_config(client: AsyncChainKVClient, cfg: Config, trace, thinks, args, tag: str) -> list[dict]:
    sem = asyncio.Semaphore(args.concurrency)
    max_ttl = EngineConfig.max_pin_ttl_s if args.max_pin_ttl_s is None else args.max_pin_ttl_s  # the server's
    policy = HintPolicy(args.hint_priority, args.pin_slack_s, max_ttl)
    rows: list[dict] = []
    base = {"max_tokens": args.output_tokens, "ignore_eos": True, "temperature": 0.0}
    method = {"method": cfg.method}
    if cfg.method != "dense":
        method["budget"] = args.method_budget

    async def session(i: int) -> None:
        async with sem:
            sid = f"{tag}-{cfg.name.replace('+', '-')}-s{i}"
            transcript: list[dict] = []
            t_start = time.perf_counter()
            for k, msgs in enumerate(trace[i]):
                if thinks[i][k]:
                    await asyncio.sleep(thinks[i][k])
                if cfg.chain:
                    opts = {**base, **(method if k == 0 else {})}
                    hints = policy.for_turn(k, thinks[i]) if cfg.hints else None
                    row, hints = await send_turn(lambda extra: one_turn(client, sid, msgs, {**opts, **extra}), hints)
                    row["hints"] = None if hints is None else hints.record()
                else:
                    turn_sid = f"{sid}-t{k}"
                    row = {**await one_turn(client, turn_sid, transcript + msgs, base), "hints": None}
                    await client.end_session(turn_sid)
                transcript += msgs + [{"role": "assistant", "content": row.pop("text")}]
                if cfg.prune and k >= 1:
                    req = pb.PruneHistoryRequest(
                        session_id=sid, prune_roles=["tool"], prune_lag=args.tool_prune_lag, prune_policy="drop"
                    )
                    row["pruned_tokens"] += (await client.prune_history(req)).pruned_tokens
                rows.append(
                    {
                        "config": cfg.name,
                        "session": i,
                        "turn": k,
                        **row,
                        "session_wall_s": time.perf_counter() - t_start,
                    }
                )
            if cfg.chain:
                await client.end_session(sid)
            if tag != "warmup":
                print(f"  {cfg.name}: session {i} done in {time.perf_counter() - t_start:.1f} s", flush=True)

    await asyncio.gather(*(session(i) for i in range(len(trace))))
    return rows


async def replay(target: str, args, params: TraceParams, profile=None, on_update=None) -> dict:
    """Replay the trace once per configuration; ``on_update(result)`` after each one (a run cut
    short keeps what it finished)."""
    trace, thinks = make_trace(params)
    configs = [Config.parse(c) for c in config_names(args.configs, args.hints)]
    summaries, all_rows, skipped = [], [], []
    result: dict = {}
    async with AsyncChainKVClient(target, timeout_s=args.turn_timeout_s) as client:
        info = await client.server_info()
        known = set(info.methods)
        known |= {f"{m}+recall" for m in known}  # the sidecar refuses a method that cannot recall
        print(
            f"sidecar: {info.model} ({info.architecture}), max_model_len {info.max_model_len}, "
            f"methods {', '.join(sorted(known))}"
        )
        for cfg in configs:
            if cfg.method not in known:
                reason = f"the sidecar has no method {cfg.method!r} (it knows {', '.join(sorted(known))})"
                print(f"{cfg.name}: skipped: {reason}")
                skipped.append({"config": cfg.name, "reason": reason})
        configs = [c for c in configs if c.method in known]
        # every configuration once on a short trace first: kernels compiled, CUDA graphs captured
        warm = TraceParams(**{**asdict(params), "sessions": min(2, params.sessions), "turns": 2, "think_s": 0.0})
        wtrace, wthinks = make_trace(warm)
        for cfg in configs:
            await run_config(client, cfg, wtrace, wthinks, args, "warmup")
        for cfg in configs:
            if profile is not None:
                profile.reset()
            t0 = time.perf_counter()
            rows = await run_config(client, cfg, trace, thinks, args, "run")
            summaries.append(summarize(cfg.name, rows, time.perf_counter() - t0))
            if profile is not None:
                summaries[-1]["profile"] = profile.report()
            all_rows += rows
            s = summaries[-1]
            print(
                f"{cfg.name:<16} ttft {s['mean_ttft_s'] * 1e3:8.1f} ms  p90 {s['p90_ttft_s'] * 1e3:8.1f} ms  "
                f"tpot {s['mean_tpot_s'] * 1e3:6.1f} ms  busy {s['mean_busy_s']:7.2f} s  "
                f"makespan {s['makespan_s']:7.2f} s  sessions/min {s['sessions_per_min']:6.1f}  "
                f"prefilled {s['prefilled_tokens']:>7}  reused {s['reused_tokens']:>7}  pruned {s['pruned_tokens']:>6}  "
                f"tiers {s['source_tiers']}"
            )
            if s["recall"]["recalls"] or s["recall"]["d2h_bytes"]:
                t = s["recall"]
                print(
                    f"{'':<16} recall: {t['d2h_bytes'] / 1e9:.2f} GB to host, {t['h2d_bytes'] / 1e9:.2f} GB back, "
                    f"{t['pages_fetched_per_turn']:.0f} pages fetched per turn, {t['recalls']} recalls"
                )
            if profile is not None:
                print_report(cfg.name, s["profile"])
            result = {
                "model": info.model,
                "architecture": info.architecture,
                "trace": asdict(params),
                "concurrency": args.concurrency,
                "method_budget": args.method_budget,
                "prune_lag": args.tool_prune_lag,
                "rows": _with_ratios(summaries),
                "skipped": skipped,
                "turn_rows": all_rows,
            }
            if on_update is not None:
                on_update(result)
    return result


def _with_ratios(summaries: list[dict]) -> list[dict]:
    """Each configuration against nochain (re-prefilling every turn) and against dense chain caching
    (the strongest baseline: what a prefix-caching server gives): busy time, makespan, mean TTFT."""
    for ref_name, tag in (("nochain", ""), ("dense", "_vs_dense")):
        ref = next((s for s in summaries if s["config"] == ref_name), None)
        for s in summaries:
            s["speedup" + tag] = ref["mean_busy_s"] / s["mean_busy_s"] if ref else None
            s["makespan_speedup" + tag] = ref["makespan_s"] / s["makespan_s"] if ref else None
            s["ttft_speedup" + tag] = ref["mean_ttft_s"] / s["mean_ttft_s"] if ref else None
    return summaries


# --- the sidecar -------------------------------------------------------------------------------------


def prep_tokenizer(dest: Path) -> None:
    from engine.model.loader import resolve_model_dir

    src = resolve_model_dir("smollm2")
    dest.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copy2(src / name, dest / name)
    print(f"tokenizer files of {src.name} copied into {dest}")


def random_weight_dir(shape: str, tokenizer: Path) -> str:
    """An HF folder with ``shape``'s config (benchmarks/decode_throughput.py), the tokenizer's
    files, and its vocabulary size."""
    from transformers import AutoTokenizer

    from benchmarks.decode_throughput import write_config

    d = Path(write_config(shape, 0))
    for name in TOKENIZER_FILES:
        if (tokenizer / name).is_file():
            shutil.copy2(tokenizer / name, d / name)
    tok = AutoTokenizer.from_pretrained(str(d))
    cfg = json.loads((d / "config.json").read_text())
    cfg["vocab_size"] = len(tok)
    cfg["bos_token_id"], cfg["eos_token_id"] = tok.bos_token_id, tok.eos_token_id
    (d / "config.json").write_text(json.dumps(cfg, indent=1))
    return str(d)


def start_sidecar(args):
    from engine.llm import LLMEngine
    from sidecar.cli.engine_args import engine_config_from_args
    from sidecar.turns.protocol import Limits
    from sidecar.grpc.server import ServerOptions, ServerThread

    if args.random_weights:
        if not args.tokenizer or not Path(args.tokenizer).is_dir():
            raise SystemExit("--random-weights needs --tokenizer DIR (make one with --prep-tokenizer)")
        args.model = random_weight_dir(args.random_weights, Path(args.tokenizer))
    config = engine_config_from_args(args)
    t0 = time.perf_counter()
    engine = LLMEngine(config, random_weights=bool(args.random_weights))
    print(
        f"engine: {engine.model_dir.name} on {engine.device} ({engine.dtype}), {engine.pool.num_pages} pages, "
        f"loaded in {time.perf_counter() - t0:.1f} s"
    )
    server = ServerThread(
        engine,
        ServerOptions(port=0, limits=Limits(default_max_tokens=args.output_tokens), max_message_bytes=64 * 2**20),
    )
    port = server.start()
    return server, engine, f"127.0.0.1:{port}"


def main() -> None:
    from sidecar.cli.engine_args import add_engine_args

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", default="nochain,dense,snapkv,quest,dense+prune")
    ap.add_argument("--target", default=None, help="an existing sidecar (default: one in this process)")
    ap.add_argument("--concurrency", type=int, default=2)
    ap.add_argument("--method-budget", type=int, default=512, help="KV tokens per head of the sparse methods' sessions")
    ap.add_argument(
        "--tool-prune-lag", type=int, default=1, help="+prune: drop tool spans at least this many turns old"
    )
    ap.add_argument("--turn-timeout-s", type=float, default=600.0)
    ap.add_argument(
        "--hints",
        action="store_true",
        help="add a +hints twin of every chain configuration (benchmarks/agent_hints.py)",
    )
    ap.add_argument("--hint-priority", type=int, default=1, help="+hints: the priority every turn carries")
    ap.add_argument(
        "--pin-slack-s", type=float, default=1.0, help="+hints: a pin's TTL is the tool's run time plus this"
    )
    for f in TraceParams.__dataclass_fields__.values():
        ap.add_argument("--" + f.name.replace("_", "-"), type=type(f.default), default=f.default)
    ap.add_argument(
        "--random-weights",
        default=None,
        metavar="SHAPE",
        help="random weights of this shape (benchmarks/decode_throughput.py SHAPES, e.g. llama-3.1-8b)",
    )
    ap.add_argument("--tokenizer", default=None, metavar="DIR", help="with --random-weights: the tokenizer folder")
    ap.add_argument(
        "--prep-tokenizer", default=None, metavar="DIR", help="copy SmolLM2's tokenizer files into DIR and exit"
    )
    ap.add_argument(
        "--profile",
        choices=["sync", "host"],
        default=None,
        help="time the engine thread's spans per configuration (benchmarks/serving_profile.py); sync: "
        "charge GPU work to the span that queued it (attribution, not the unprofiled speed)",
    )
    ap.add_argument("--count-syncs", action="store_true", help="with --profile host: count host<->device syncs by line")
    ap.add_argument(
        "--torch-profile-steps",
        type=int,
        default=0,
        help="with --profile: trace this many eager prefill passes per configuration with torch's profiler",
    )
    ap.add_argument(
        "--torch-profile-from",
        type=int,
        default=3,
        help="... starting at this prefill pass of the configuration (later passes meet longer histories)",
    )
    ap.add_argument("--out", default="benchmarks/results/agent_trace_cpu.json")
    add_engine_args(ap)
    args = ap.parse_args()
    if args.prep_tokenizer:
        prep_tokenizer(Path(args.prep_tokenizer))
        return
    params = TraceParams(**{k: getattr(args, k) for k in TraceParams.__dataclass_fields__})
    server = engine = None
    target = args.target
    if target is None:
        server, engine, target = start_sidecar(args)
    profile = None
    if args.profile:
        if engine is None:
            raise SystemExit("--profile needs the in-process sidecar (no --target)")
        profile = ServingProfile(
            engine,
            args.profile,
            count_syncs=args.count_syncs,
            torch_steps=args.torch_profile_steps,
            torch_from=args.torch_profile_from,
        )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    extra = {
        "command": "python " + " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]]),
        "description": (
            "Synthetic agent traces replayed over gRPC (benchmarks/agent_trace.py). speedup = "
            "nochain mean busy time (sum of a session's turn latencies) / this configuration's; "
            "*_vs_dense: the same against dense chain caching."
        ),
    }
    if engine is not None:
        import torch

        extra["device"] = torch.cuda.get_device_name(engine.device) if engine.device.type == "cuda" else "cpu"
        extra["engine"] = {k: v for k, v in engine.config.to_dict().items() if k != "model"}
        extra["random_weights"] = args.random_weights

    def write(result: dict) -> None:
        out.write_text(json.dumps({**result, **extra}, indent=1))

    try:
        result = asyncio.run(replay(target, args, params, profile, on_update=write))
    finally:
        if server is not None:
            server.stop(grace=5)
    if engine is not None and result.get("rows"):  # the engine's own rates, and the bound they give
        from benchmarks.makespan_bound import add_bounds

        rates = add_bounds(result, engine, make_trace(params)[1], args.concurrency, args.method_budget)
        for s in result["rows"]:
            if s["recall"]["d2h_bytes"]:
                s["recall"].update(recall_bandwidth(s, rates.h2d_gb_s, rates.d2h_gb_s))
                b = s["recall"]
                print(
                    f"  {s['config']:<16} recall copies at the measured {rates.h2d_gb_s:.1f} GB/s (h2d) and "
                    f"{rates.d2h_gb_s:.1f} GB/s (d2h): {b['h2d_s_at_bandwidth']:.2f} s + {b['d2h_s_at_bandwidth']:.2f} s, "
                    f"{100 * b['copy_share_of_makespan']:.1f}% of the makespan"
                )
        write(result)
        for s in result["rows"]:
            b, m = s["lower_bound"], s["breakdown"].get("mean_s", {})
            print(
                f"  {s['config']:<16} makespan {s['makespan_s']:.1f} s / bound {b['bound_s']:.1f} s "
                f"({b['bound_by']}) = {s['makespan_over_bound']:.2f}x; per turn "
                + ", ".join(f"{k[:-2]} {v * 1e3:.0f} ms" for k, v in m.items())
            )
    print(f"wrote {out}")
    for s in result.get("rows", []):
        sp = f"{s['speedup']:.2f}x" if s["speedup"] else "-"
        vd = f"{s['speedup_vs_dense']:.2f}x" if s["speedup_vs_dense"] else "-"
        print(f"  {s['config']:<16} vs nochain {sp}  vs dense {vd}  makespan {s['makespan_s']:.1f} s")


if __name__ == "__main__":
    main()
