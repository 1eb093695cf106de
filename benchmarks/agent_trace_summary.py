"""One agent-trace configuration's summary (benchmarks/agent_trace.py): makespan, TTFT and TPOT
percentiles, tiers, token counts, the recall tier's copies and the agent hints sent."""

from __future__ import annotations

import collections
import statistics


def summarize(cfg: str, rows: list[dict], makespan: float) -> dict:
    by_session: dict[int, list[dict]] = {}
    for r in rows:
        by_session.setdefault(r["session"], []).append(r)
    jct = [max(r["session_wall_s"] for r in rs) for rs in by_session.values()]
    busy = [sum(r["latency_s"] for r in rs) for rs in by_session.values()]
    ttft = sorted(r["ttft_s"] for r in rows)
    later = [r for r in rows if r["turn"] > 0]
    turns = sorted({r["turn"] for r in rows})
    return {
        "config": cfg,
        "turns": len(rows),
        "mean_ttft_s": statistics.fmean(ttft),
        "p50_ttft_s": ttft[len(ttft) // 2],
        "p90_ttft_s": ttft[min(len(ttft) - 1, int(0.9 * len(ttft)))],
        "mean_ttft_later_turns_s": statistics.fmean(r["ttft_s"] for r in later) if later else None,
        "mean_tpot_s": statistics.fmean(r["tpot_s"] for r in rows),
        "mean_jct_s": statistics.fmean(jct),
        "mean_busy_s": statistics.fmean(busy),
        "makespan_s": makespan,
        "sessions_per_min": 60.0 * len(by_session) / makespan,
        "source_tiers": dict(collections.Counter(r["source_tier"] for r in rows)),
        "prefilled_tokens": sum(r["prefilled_tokens"] for r in rows),
        "reused_tokens": sum(r["reused_tokens"] for r in rows),
        "pruned_tokens": sum(r["pruned_tokens"] for r in rows),
        "generated_tokens": sum(r["generated_tokens"] for r in rows),
        "final_kv_tokens": statistics.fmean(
            max(rs, key=lambda r: r["turn"])["kv_tokens"] for rs in by_session.values()
        ),
        "ttft_by_turn_s": [statistics.fmean(r["ttft_s"] for r in rows if r["turn"] == t) for t in turns],
        "recall": recall_traffic(rows),
        "hints_sent": _hints_sent(rows),
    }


def recall_traffic(rows: list[dict]) -> dict:
    """The recall tier's copies over a configuration's turns (Usage.recall): totals and per turn."""
    keys = ("d2h_bytes", "h2d_bytes", "pages_fetched", "recalled_tokens", "recalls")
    total = {k: sum(r.get("recall", {}).get(k, 0) for r in rows) for k in keys}
    n = max(1, len(rows))
    return {**total, **{f"{k}_per_turn": total[k] / n for k in ("d2h_bytes", "h2d_bytes", "pages_fetched")}}


def recall_bandwidth(row: dict, h2d_gb_s: float, d2h_gb_s: float) -> dict:
    """A configuration's recall traffic against the measured copy bandwidth: the seconds its bytes
    take at that bandwidth (the copy time the engine would wait if the copies did not overlap),
    in total and as a share of the makespan."""
    t = row["recall"]
    h2d = t["h2d_bytes"] / (h2d_gb_s * 1e9) if h2d_gb_s else 0.0
    d2h = t["d2h_bytes"] / (d2h_gb_s * 1e9) if d2h_gb_s else 0.0
    return {
        "h2d_s_at_bandwidth": h2d,
        "d2h_s_at_bandwidth": d2h,
        "copy_share_of_makespan": (h2d + d2h) / row["makespan_s"] if row["makespan_s"] else 0.0,
        "h2d_gb_s_measured": h2d_gb_s,
        "d2h_gb_s_measured": d2h_gb_s,
    }


def _hints_sent(rows: list[dict]) -> dict | None:
    """How many turns carried each hint (None: the configuration sent none)."""
    sent = [r["hints"] for r in rows if r["hints"] is not None]
    if not sent:
        return None
    return {
        "turns": len(sent),
        "priority": sum(h["priority"] is not None for h in sent),
        "pins": sum(h["pin_ttl_s"] is not None for h in sent),
        "pins_refused": sum(h["pin_refused"] for h in sent),
        "releases": sum(h["release"] for h in sent),
        "expected_returns": sum(h.get("expected_return_s") is not None for h in sent),
        "mean_pin_ttl_s": statistics.fmean([h["pin_ttl_s"] for h in sent if h["pin_ttl_s"] is not None] or [0.0]),
    }
