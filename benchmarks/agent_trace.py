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
                   a priority, a pin while each tool runs and the tool's run time as the expected
                   return (a session demoted meanwhile is prefetched before it), a release with the
                   last turn; ``--hints`` adds a +hints twin of every chain configuration, so both
                   run side by side

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
import shutil
import sys
import time
from dataclasses import asdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from agent_adapters.client import AsyncChainKVClient  # noqa: E402
from benchmarks.agent_trace_sessions import Config, config_names, run_config  # noqa: E402
from benchmarks.agent_trace_shape import TraceParams, make_trace  # noqa: E402
from benchmarks.agent_trace_summary import recall_bandwidth, summarize  # noqa: E402
from benchmarks.serving_profile import ServingProfile, print_report  # noqa: E402

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")


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
