"""One speed x quality table for chain sessions (issue 26's frontier), from the committed results.

Quality: ``agent_fidelity_cpu.json`` (teacher-forced agreement with dense, attention recall on the
device and device + cold tier) and ``agent_quality_cpu*.json`` (exact match over the needle and
shared families). Speed: the H200 agent traces ``agent_trace_gpu_recall_run2_{pool24,full}.json``
(SCALE shape, 24 GB KV pool and the whole pool; ratios against dense chain caching taken side by
side within each run). Writes ``benchmarks/results/recall_frontier.json`` (rendered into
docs/benchmarks.md by report.py) and prints the table; a configuration qualifies at a budget when
its exact match is within 5 points of dense's and its agreement is at least 0.97.

    python benchmarks/frontier.py
"""

from __future__ import annotations

import json
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
EM_MARGIN, AGREEMENT_FLOOR = 0.05, 0.97


def _load(name: str) -> dict:
    path = RESULTS / name
    return json.loads(path.read_text()) if path.exists() else {}


def _by_config(rows: list[dict]) -> dict[str, dict]:
    return {r["config"]: r for r in rows}


def main() -> None:
    fidelity = _by_config(_load("agent_fidelity_cpu.json").get("summary", []))
    em = {}
    for name in ("agent_quality_cpu.json", "agent_quality_cpu_recall.json"):
        em.update({r["config"]: r["mean"] for r in _load(name).get("summary", []) if r.get("prune") == "none"})
    speed = {}
    for shape in ("pool24", "full"):
        for r in _load(f"agent_trace_gpu_recall_run2_{shape}.json").get("rows", []):
            speed.setdefault(r["config"], {})[shape] = (r.get("makespan_speedup_vs_dense"), r["p90_ttft_s"])
    dense_em = em.get("dense")
    rows = []
    for method in (
        "dense",
        "snapkv",
        "snapkv+recall",
        "streaming_llm",
        "streaming_llm+recall",
        "kvzip",
        "kvzip+recall",
    ):
        for budget in (None,) if method == "dense" else (0.5, 0.25, 0.1):
            key = method if budget is None else f"{method}@{budget}"
            f = fidelity.get(key, {})
            s24, sfull = speed.get(method, {}).get("pool24"), speed.get(method, {}).get("full")
            row = {
                "config": key,
                "agreement": f.get("agreement"),
                "attention_recall_device": f.get("attention_recall_device"),
                "attention_recall_held": f.get("attention_recall_held"),
                "exact_match": em.get(key),
                "x_dense_pool24": s24[0] if s24 and budget in (None, 0.25) else None,
                "p90_ttft_s_pool24": s24[1] if s24 and budget in (None, 0.25) else None,
                "x_dense_full_pool": sfull[0] if sfull and budget in (None, 0.25) else None,
            }
            if all(row[k] is None for k in ("agreement", "exact_match", "x_dense_pool24")):
                continue
            ok_em = (
                row["exact_match"] is not None and dense_em is not None and row["exact_match"] >= dense_em - EM_MARGIN
            )
            ok_agree = row["agreement"] is None or row["agreement"] >= AGREEMENT_FLOOR
            row["keeps_quality"] = bool(ok_em and ok_agree)
            rows.append(row)
    out = {
        "description": (
            "Speed x quality of chain-session configurations (benchmarks/frontier.py). Quality on CPU with "
            "SmolLM2: teacher-forced agreement and attention recall from agent_fidelity_cpu.json (budget 0.1 of "
            "~1.9K-token transcripts), exact match (needle + shared) from agent_quality_cpu*.json (~200-token "
            "contexts). Speed on the H200: makespan against dense chain caching, side by side in one run, on the "
            "SCALE trace at a method budget of 4096 KV tokens per head (about 25% of its 16-25K contexts); "
            "shown on the 0.25 rows. keeps_quality: exact match within 5 points of dense and agreement >= 0.97 "
            "where measured. Empty cells were not measured (no device time for the GPU quality run yet). The +recall "
            "exact-match rows use the current policy (recall_reserve 0.25: the method keeps 75% of the budget, a "
            "recall fills the rest); the +recall speed and agreement rows were measured with the earlier displacing "
            "policy (recall_reserve 0) and synchronous cold-tier copies."
        ),
        "rows": rows,
    }
    (RESULTS / "recall_frontier.json").write_text(json.dumps(out, indent=1) + "\n")
    for r in rows:
        print({k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items()})


if __name__ == "__main__":
    main()
