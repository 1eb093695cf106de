"""The docs/benchmarks.md section (tables, plot) of an agent_fidelity results file.

benchmarks/report.py calls ``section(d, stem)`` for ``agent_fidelity_*.json``; the plot (agreement with
dense against the budget, one line per method with and without recall) is written next to the JSON.
"""

from __future__ import annotations

from benchmarks.report_format import RESULTS, line_chart_svg, percent, table


def section(d: dict, stem: str) -> str:
    where = d.get("device", "?")
    dense_positions = next((s["positions"] for s in d["summary"] if s["method"] == "dense"), 0)
    parts = [
        f"## Agent fidelity at {d['mean_tokens']:.0f} tokens ({'GPU' if 'gpu' in stem else 'CPU'})",
        f"`benchmarks/agent_fidelity.py --size {d['size']}` on {where}, {d['model']}: {d['samples']} agent "
        f"transcripts (seed {d['seed']}) of {d['steps']} tool calls (the repo's code, benchmark JSON, logs, docs as "
        f"search results) then {d['questions']} questions about earlier tool outputs, through the engine's chain API. "
        "Dense on the chain writes the replies; each configuration is teacher-forced to them on the decode path "
        "(so `+recall` acts), budgets are `budget_ratio`s. agree: the share of the question replies' positions "
        "where the configuration's argmax is dense's token; attention device / held: the share of dense's "
        "attention (reply queries over the context, averaged over layers and heads) on positions the session "
        "holds at the reply's first step on the device / on the device or recallable from the cold tier; EM: "
        "the answer in the free-running reply (known up to the first disagreement); KV / cold: KV entries on the "
        f"device / in the cold tier at the end over the history's. Dense's own exact match: "
        f"{percent(d['dense_exact_match'])}; {dense_positions} reply positions.",
    ]
    dense = [s for s in d["summary"] if s["method"] == "dense"]
    cols = [
        ("method", "method"),
        ("recall", "recall"),
        ("agreement", "agree"),
        ("attention_recall_device", "attention device"),
        ("attention_recall_held", "attention held"),
        ("exact_match", "EM"),
        ("kv_fraction", "KV"),
        ("cold_fraction", "cold"),
    ]
    fmt = lambda s: dict(  # noqa: E731
        s,
        recall=_recall_label(s),
        exact_match=percent(s["exact_match"]),
        kv_fraction=percent(s["kv_fraction"]),
        cold_fraction=percent(s["cold_fraction"]),
    )
    for b in d["budgets"]:
        rows = [s for s in d["summary"] if s["budget"] == b]
        if rows:
            parts.append(f"Budget {percent(b)}:")
            parts.append(table([fmt(s) for s in dense + rows], cols))
    if d.get("skipped"):
        parts.append("Failed: " + "; ".join(f"`{x['config']}` ({x['error'][:120]})" for x in d["skipped"]))
    if d.get("note"):
        parts.append(d["note"])
    budgets = sorted(d["budgets"])
    series = {}
    for s in d["summary"]:
        if s["method"] == "dense":
            continue
        name = s["method"] + ("+recall" + _args(s) if s["recall"] else "")
        series.setdefault(name, {})[s["budget"]] = s["agreement"]
    series = {k: [v.get(b, 0.0) for b in budgets] for k, v in series.items() if len(v) == len(budgets)}
    if series and len(budgets) >= 2:
        name = f"{stem}_agreement.svg"
        (RESULTS / name).write_text(
            line_chart_svg(
                series,
                f"Agreement with dense by budget ({where})",
                "budget (fraction of the context kept)",
                "agreement",
                xticks=[percent(b) for b in budgets],
            )
        )
        parts.append(f"![agreement with dense by budget](../benchmarks/results/{name})")
    return "\n\n".join(parts)


def _args(s: dict) -> str:
    """A recall variant's parameters, as the harness names its configuration (empty: the defaults)."""
    args = s.get("recall_args") or {}
    return f"[{','.join(f'{k}={v}' for k, v in sorted(args.items()))}]" if args else ""


def _recall_label(s: dict) -> str:
    """``no``, ``yes`` (the defaults) or ``yes [name=value,...]``: rows of several variants differ."""
    return ("yes " + _args(s)).strip() if s["recall"] else "no"
