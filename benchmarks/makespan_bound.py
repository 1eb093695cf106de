"""A lower bound on an agent trace's makespan, and where its turns' time went.

From the engine's measured rates (benchmarks/engine_rates.py) and a configuration's turns as they
ran (benchmarks/agent_trace.py rows, each with the engine's timing record):

* work: every turn's necessary prefill (its prefilled tokens less any history it recomputed, on top
  of the context it attended to: the cached history, or at most the method's budget per head for a
  sparse method) at the measured prefill cost, plus every decode step (a turn's tokens after its
  first) at the step time of the largest batch the run reaches, shared by that many sequences;
* critical path: for each session, its think times plus each turn alone (its prefill, then its
  decode steps at batch 1); the longest session's.

``bound = max(work, critical path)``: no schedule of this configuration's work on this engine can
finish sooner (swap-ins and recomputation are left out: a schedule that needs none is the ideal).
The breakdown averages the engine's per-turn timing (sidecar Usage.timing) by cause.
"""

from __future__ import annotations

import statistics

from benchmarks.engine_rates import EngineRates, measure

BREAKDOWN_KEYS = ("waiting_s", "swap_in_s", "recompute_s", "prefill_s", "decode_s", "decode_stall_s", "other_s")


def _prefill(rates: EngineRates, row: dict, budget: int | None) -> float:
    timing = row.get("timing") or {}
    tokens = max(0, row["prefilled_tokens"] - int(timing.get("recompute_tokens", 0)))
    context = row["reused_tokens"] if budget is None else min(row["reused_tokens"], budget)
    return rates.prefill_cost(context, tokens)


def lower_bound(
    rows: list[dict], thinks: list[list[float]], rates: EngineRates, batch: int, budget: int | None
) -> dict:
    """``rows``: one configuration's turns; ``thinks[s][k]``: the think time before session s's turn
    k; ``batch``: the most sequences that decode together; ``budget``: a sparse method's KV tokens per
    head (None: dense)."""
    prefill_work = sum(_prefill(rates, r, budget) for r in rows)
    decode_steps = sum(max(0, r["generated_tokens"] - 1) for r in rows)
    decode_work = decode_steps / batch * rates.decode_time(batch)
    step1 = rates.decode_time(1)
    paths: dict[int, float] = {}
    for r in rows:
        s = r["session"]
        paths[s] = paths.get(s, 0.0) + _prefill(rates, r, budget) + max(0, r["generated_tokens"] - 1) * step1
    for s in paths:
        paths[s] += sum(thinks[s])
    work = prefill_work + decode_work
    critical = max(paths.values()) if paths else 0.0
    return {
        "prefill_work_s": prefill_work,
        "decode_work_s": decode_work,
        "work_s": work,
        "critical_path_s": critical,
        "bound_s": max(work, critical),
        "bound_by": "work" if work >= critical else "critical path",
        "decode_batch": batch,
    }


def breakdown(rows: list[dict]) -> dict:
    """Mean seconds per turn by cause, and each cause's share of the turns' total engine time."""
    timed = [r["timing"] for r in rows if r.get("timing")]
    if not timed:
        return {}
    mean = {k: statistics.fmean(t[k] for t in timed) for k in BREAKDOWN_KEYS}
    total = sum(t["total_s"] for t in timed) or 1.0
    return {
        "turns_timed": len(timed),
        "mean_s": mean,
        "share": {k: sum(t[k] for t in timed) / total for k in BREAKDOWN_KEYS},
        "mean_total_s": statistics.fmean(t["total_s"] for t in timed),
        "recompute_tokens": sum(int(t["recompute_tokens"]) for t in timed),
    }


def add_bounds(result: dict, engine, thinks: list[list[float]], concurrency: int, method_budget: int) -> EngineRates:
    """Measure the engine's rates (its server stopped) at the run's contexts and batch sizes, and give
    each configuration of ``result`` its bound, makespan / bound and breakdown."""
    turns = result["turn_rows"]
    contexts = [r["reused_tokens"] + r["prefilled_tokens"] for r in turns]
    batch = max(1, min(concurrency, engine.config.max_num_seqs, len(thinks)))
    batches = sorted({1, batch, *[b for b in (2, 4, 8, 16, 32, 64, 128) if b < batch]})
    decode_context = int(statistics.fmean(r["history_tokens"] for r in turns))
    rates = measure(engine, contexts, batches, decode_context)
    for row in result["rows"]:
        base = row["config"].partition("+")[0]
        budget = None if base in ("dense", "nochain") else method_budget
        mine = [r for r in turns if r["config"] == row["config"]]
        row["lower_bound"] = lower_bound(mine, thinks, rates, batch, budget)
        row["makespan_over_bound"] = row["makespan_s"] / row["lower_bound"]["bound_s"]
        row["breakdown"] = breakdown(mine)
    result["engine_rates"] = rates.as_dict()
    return rates
