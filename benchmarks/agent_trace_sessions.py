"""One configuration of benchmarks/agent_trace.py (nochain, dense, a method, with +prune, +recall,
+hints) and its sessions driven through the gRPC client: each session sends its turns after their
think times at most ``--concurrency`` at a time, and every turn becomes a row of client-side timings
(TTFT, latency, TPOT) and the server's Usage (tokens, tier, timing record, recall copies)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from agent_adapters.client import AsyncChainKVClient
from agent_adapters.messages import TextDelta, TurnResult
from benchmarks.agent_hints import HintPolicy, send_turn
from engine.config import EngineConfig
from sidecar._proto.chainkv.v1 import sidecar_pb2 as pb


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
