"""The docs/benchmarks.md section (tables, plot) of an agent_quality results file.

benchmarks/report.py calls ``section(d, stem)`` for ``agent_quality_*.json``; the plot (accuracy
against turn distance, one line per method, one chart per budget) is written next to the JSON.
"""

from __future__ import annotations

from benchmarks.report_format import RESULTS, line_chart_svg, percent, table


def _budget(b) -> str:
    if b is None:
        return "-"
    return f"{b * 100:g}%" if isinstance(b, float) else f"{b} tok"


def section(d: dict, stem: str) -> str:
    where = d.get("device", "?")
    fams = [f for f in ("needle", "state", "shared") if any(r["family"] == f for r in d["rows"])]
    cal = [dict(c, accuracy=percent(c["accuracy"]), kept="yes" if c["kept"] else "dropped") for c in d["calibration"]]
    parts = [
        f"## Agent quality over turns ({'GPU' if 'gpu' in stem else 'CPU'})"
        + ("" if stem in ("agent_quality_cpu", "agent_quality_gpu") else f": {stem}"),
        f"`benchmarks/agent_quality.py` on {where}, {d['model']}, size `{d['size']}`, {d['samples']} samples per "
        "size (seed %d), through the engine's chain API (`LLMEngine.add_turn`, in process). Families: a needle "
        "record in turn 1's tool output asked for in turn N (needle), a key updated by tool outputs asked for "
        "its latest value (state), one file read in turn 1 then a question per turn about another part of it "
        "(shared). Exact match. Budgets are fractions of each sample's final context, fixed for the session "
        "(tokens per kv-head); +lag1 drops tool output one turn old, +keep keeps %d%% of it (keep_ratio); "
        "/once compresses the transcript once before each question (kvpress-style). agree = answers equal to "
        "dense re-prefill's; KV = KV entries kept at the end / the history's."
        % (d["seed"], round(100 * d["prune_keep_ratio"])),
        "Calibration (dense re-prefill; sizes under %s dropped):" % percent(d["calibrate"]),
        table(
            cal,
            [
                ("family", "family"),
                ("size", "size"),
                ("mean_final_tokens", "final tokens"),
                ("accuracy", "dense re-prefill"),
                ("kept", "kept"),
            ],
        ),
    ]
    rows = [
        dict(
            s,
            budget=_budget(s["budget"]),
            **{f: percent(s.get(f)) for f in fams + ["mean", "agreement", "kv_fraction"]},
        )
        for s in d["summary"]
    ]
    cols = (
        [("config", "config"), ("budget", "budget"), ("prune", "prune")]
        + [(f, f) for f in fams]
        + [("mean", "mean"), ("agreement", "agree"), ("kv_fraction", "KV")]
    )
    parts.append(table(rows, cols))
    if d.get("recommended"):
        parts.append(
            "Recommended default per budget (best mean accuracy on the chain among the configurations "
            "that held their budget; ties to the smaller KV), and the best per family: "
            + "; ".join(
                f"{_budget(float(b) if '.' in b else b)}: `{r['config']}` ({percent(r['mean'])}"
                + "".join(
                    f", {fam} `{x['config']}` {percent(x['accuracy'])}" for fam, x in r.get("by_family", {}).items()
                )
                + ")"
                for b, r in d["recommended"].items()
            )
            + "."
        )
    if d.get("note"):
        parts.append(d["note"])
    for b in d.get("budgets", []):
        series, dists = {}, set()
        chosen = [s for s in d["summary"] if s["mode"] == "chain" and s["prune"] == "none" and s["budget"] in (b, None)]
        chosen += [s for s in d["summary"] if s["mode"] == "reprefill"]
        for s in chosen:
            dists |= set(s["by_distance"])
        xs = sorted(dists, key=int)
        for s in chosen:
            series[s["config"].split("@")[0]] = [s["by_distance"].get(x, 0.0) for x in xs]
        if not series or len(xs) < 2:
            continue
        name = f"{stem}_{_budget(b).replace('%', 'pct').replace(' ', '')}.svg"
        (RESULTS / name).write_text(
            line_chart_svg(
                series,
                f"Accuracy by turn distance, budget {_budget(b)} ({where})",
                "turns between the fact and the question",
                "accuracy",
                xticks=xs,
            )
        )
        parts.append(f"![accuracy by turn distance at {_budget(b)}](../benchmarks/results/{name})")
    return "\n\n".join(parts)
