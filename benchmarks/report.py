"""Render docs/benchmarks.md from the committed results (benchmarks/results/*.json).

Each benchmark script saves JSON; this turns every result file it knows into a section with a
table, so the numbers in the docs are always the committed ones.

    python benchmarks/report.py
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: benchmarks/ is not on the path

from benchmarks import agent_fidelity_report, agent_quality_report  # noqa: E402
from benchmarks.report_format import RESULTS, ROOT, line_chart_svg, table  # noqa: E402

DOC = ROOT / "docs" / "benchmarks.md"


def decode_section(d: dict, stem: str = "decode_throughput") -> str:
    cols = [
        ("method", "method"),
        ("batch", "batch"),
        ("context", "context"),
        ("budget", "budget"),
        ("kv", "KV"),
        ("kv_tokens_per_head", "KV tokens/head"),
        ("tokens_per_s", "tokens/s"),
        ("step_ms", "step ms"),
        ("roofline_fraction", "roofline"),
        ("ratio_vs_dense", "x dense (largest batch)"),
        ("ratio_vs_dense_same_batch", "x dense (same batch)"),
        ("roofline_ratio_same_batch", "roofline x dense (same batch)"),
        ("hf_step_ms", "HF step ms"),
        ("ratio_vs_hf", "x HF"),
        ("prefill_s", "prefill s"),
    ]
    hf = d.get("hf_step_ms") or {}
    hf_line = ", ".join(f"batch {b}: {ms:.1f} ms" for b, ms in sorted(hf.items(), key=lambda x: int(x[0]))) or "not run"
    return "\n\n".join(
        [
            "## Decode throughput (GPU)" + ("" if stem == "decode_throughput" else f" ({stem.split('_')[-1]})"),
            f"`benchmarks/decode_throughput.py` on {d['device']}, {d['shape']} shapes, random bf16 weights; "
            f"measured copy bandwidth {d['copy_bandwidth_tb_s']:.2f} TB/s. Our dense engine fits {d['dense_largest_batch']} "
            f"sequences at this context. HF transformers (its own model and DynamicCache, sdpa), same run: {hf_line}.",
            "`roofline` = (weights + KV bytes a step must read) / (copy bandwidth x step time); `roofline x dense "
            "(same batch)` = the ratio to dense at the same batch that the bytes alone allow. " + d.get("note", ""),
            table(d["rows"], cols),
            f"![decode throughput](../benchmarks/results/{stem}.png)",
        ]
    )


def kernel_section(d: dict) -> str:
    cols = [
        ("kernel", "kernel"),
        ("batch", "batch"),
        ("context", "context"),
        ("page_size", "page"),
        ("block_t", "BLOCK_T"),
        ("num_warps", "warps"),
        ("num_stages", "stages"),
        ("splits", "splits"),
        ("ms", "ms"),
        ("tb_s", "TB/s"),
        ("fraction", "of copy bw"),
    ]
    return "\n\n".join(
        [
            "## Paged decode kernel vs the bandwidth roofline",
            f"`benchmarks/kernel_bandwidth.py` on {d['device']} (copy bandwidth {d['copy_bandwidth_tb_s']:.2f} TB/s): one "
            "decode-attention call over scattered head-granular pages (8 kv-heads, GQA 4, head_dim 128, bf16) next to "
            "SDPA on contiguous KV.",
            table(d["rows"], cols),
        ]
    )


def quant_section(d: dict) -> str:
    cols = [
        ("method", "method"),
        ("prompt", "prompt"),
        ("agreement", "top-1 agreement"),
        ("kl_mean", "KL mean"),
        ("kl_max", "KL max"),
        ("free_running_prefix", "identical prefix"),
        ("bytes_per_token", "B / cached token"),
        ("x_bf16", "x bf16"),
        ("context_per_head", "tokens / head"),
    ]
    return "\n\n".join(
        [
            "## KV quantization quality and memory (kivi, fp8)",
            f"`benchmarks/quant_quality.py` on {d['device']} ({d['dtype']}), {d['model']}, {d['tokens']} greedy tokens, "
            f"page size {d['page_size']}. Each quantized engine decodes the dense engine's tokens (teacher forcing), so "
            "every position compares the same context; `identical prefix` is how many tokens free-running generation "
            "shares with dense. Bytes per cached token (per layer and kv-head) come from the pool's accounting of the "
            "session's pages (codes, scales, zero points, positions, and a full-precision staging page for each open "
            f"kivi page), against {d['bf16_bytes_per_token']:.0f} B for a bf16 plain page.",
            table(d["rows"], cols),
        ]
        + ([d["note"]] if d.get("note") else [])
    )


def generic_section(name: str, d: dict) -> str:
    rows = d.get("rows") or d.get("results") or []
    if not rows or not isinstance(rows, list) or not isinstance(rows[0], dict):
        return f"## {name}\n\nSee `benchmarks/results/{name}.json`."
    cols = [(k, k) for k in rows[0] if not isinstance(rows[0][k], (list, dict))]
    intro = d.get("description") or d.get("note") or ""
    return "\n\n".join([f"## {name}", intro, table(rows, cols)])


def reliability_section(d: dict) -> str:
    load = d.get("load") or {}
    faults = table(
        d["faults"],
        [
            ("fault", "fault injected"),
            ("count", "times"),
            ("sessions", "sessions"),
            ("sessions_lost", "sessions lost"),
            ("committed_turns_lost", "committed turns lost"),
        ],
    )
    fuzz = table(
        [
            {
                "rpc": k,
                "inputs": v["inputs"],
                "crashes": v["crashes"],
                "codes": ", ".join(f"{c} {n}" for c, n in sorted(v.get("codes", {}).items())),
            }
            for k, v in d["fuzz"].items()
        ],
        [("rpc", "RPC"), ("inputs", "inputs"), ("crashes", "crashes"), ("codes", "status codes")],
    )
    load_line = (
        (
            f"{load['sessions']} concurrent sessions x {load['turns_per_session']} turns "
            f"({load['max_tokens']} tokens each) on SmolLM2 (CPU) with a {load['pool_pages']}-page pool "
            f"({load['pages_per_full_session']} pages per full session, so about "
            f"{load['pool_pages'] // max(1, load['pages_per_full_session'])} fit at a time): "
            f"{load['turns_completed']} turns completed, {load['errors']} errors, {load['sessions_lost']} sessions "
            f"lost, {load['demotions']} demotions to host RAM, {load['preemptions']} preemptions, "
            f"{load['wall_s']} s, peak RSS {load['max_rss_mb']} MB."
        )
        if load
        else "Load test not run."
    )
    return "\n\n".join(
        [
            "## Reliability (faults, fuzzing, load)",
            f"`{d.get('command', 'python benchmarks/reliability.py')}` on {d['machine']} ({d['created_at']}): "
            f"**{d['faults_injected']} faults injected, {d['sessions_lost']} sessions lost; {d['inputs_fuzzed']} inputs "
            f"fuzzed, {d['crashes']} crashes.** A resumed session continues with the same greedy tokens as an "
            "uninterrupted run.",
            faults,
            fuzz,
            load_line,
        ]
    )


def _hints_text(sent: dict | None) -> str:
    if not sent:
        return "-"
    refused = f" ({sent['pins_refused']} refused)" if sent["pins_refused"] else ""
    return f"{sent['pins']} pins{refused}, {sent['releases']} releases, priority on {sent['priority']}"


def agent_trace_section(d: dict, stem: str) -> str:
    where = d.get("device", "?")
    model = d["model"] + (f" (random {d['random_weights']} weights)" if d.get("random_weights") else "")
    t = d["trace"]
    rows = [
        dict(
            r,
            mean_ttft_ms=r["mean_ttft_s"] * 1e3,
            later_ttft_ms=(r["mean_ttft_later_turns_s"] or 0) * 1e3,
            p90_ttft_ms=r["p90_ttft_s"] * 1e3,
            tpot_ms=r["mean_tpot_s"] * 1e3,
            hints=_hints_text(r.get("hints_sent")),
        )
        for r in d["rows"]
    ]
    cols = [
        ("config", "config"),
        ("mean_ttft_ms", "TTFT ms"),
        ("later_ttft_ms", "TTFT ms (turns > 0)"),
        ("p90_ttft_ms", "p90 TTFT ms"),
        ("tpot_ms", "TPOT ms"),
        ("mean_busy_s", "busy s"),
        ("mean_jct_s", "JCT s"),
        ("makespan_s", "makespan s"),
        ("prefilled_tokens", "prefilled"),
        ("reused_tokens", "reused"),
        ("pruned_tokens", "pruned"),
        ("final_kv_tokens", "final KV entries"),
        ("speedup", "speedup (busy)"),
        ("makespan_speedup", "speedup (makespan)"),
    ]
    if any("makespan_speedup_vs_dense" in r for r in rows):  # against dense chain caching, the strongest baseline
        cols += [
            ("speedup_vs_dense", "x dense chain (busy)"),
            ("makespan_speedup_vs_dense", "x dense chain (makespan)"),
        ]
    if any(r.get("hints_sent") for r in rows):  # +hints configurations (benchmarks/agent_hints.py)
        cols.append(("hints", "hints sent"))
    title = f"Agent traces over gRPC ({'GPU' if 'gpu' in stem else 'CPU'})"
    if stem not in ("agent_trace_cpu", "agent_trace_gpu"):
        title += f": {stem}"
    parts = [
        f"## {title}",
        f"`benchmarks/agent_trace.py` on {where}, {model}: {t['sessions']} sessions x {t['turns']} turns at "
        f"concurrency {d['concurrency']}; a shared {t['system_words']}-word system prompt, tool outputs lognormal "
        f"(median {t['tool_median']} words, sigma {t['tool_sigma']}), {t['output_tokens']} output tokens per turn "
        f"(EOS ignored), think time {t['think_s']} s mean; sparse methods at {d.get('method_budget')} KV tokens "
        f"per head; +prune drops the KV of tool output {d.get('prune_lag')} turn(s) old. "
        "busy = the sum of a session's turn latencies (think time excluded), JCT = its wall time; "
        "speedup = nochain's mean busy time / the configuration's.",
        table(rows, cols),
    ]
    parts += _bound_parts(d)
    if d.get("note"):
        parts.append(d["note"])
    if d.get("skipped"):
        parts.append("Skipped: " + "; ".join(f"{s['config']} ({s['reason']})" for s in d["skipped"]) + ".")
    series = {r["config"]: [v * 1e3 for v in r["ttft_by_turn_s"]] for r in d["rows"]}
    if series:
        svg = RESULTS / f"{stem}.svg"
        svg.write_text(line_chart_svg(series, f"Time to first token by turn ({where})", "turn", "TTFT ms"))
        parts.append(f"![time to first token by turn](../benchmarks/results/{svg.name})")
    return "\n\n".join(parts)


def _bound_parts(d: dict) -> list[str]:
    """The makespan's lower bound from the engine's measured rates, and where the turns' time went
    (benchmarks/makespan_bound.py), when the run has them."""
    rows = [r for r in d["rows"] if r.get("lower_bound") or r.get("breakdown")]
    if not rows:
        return []
    if not any(r.get("lower_bound") for r in rows):
        return _breakdown_parts(rows)
    rates = d.get("engine_rates") or {}
    per_s = rates.get("prefill_tokens_per_s") or {}
    steps = rates.get("decode_step_s") or {}
    head = (
        "Lower bound on the makespan from the engine's own rates, measured in the same run after the replay "
        f"(prefill {', '.join(f'{int(float(k))} tokens at {v:,.0f} tok/s' for k, v in per_s.items())}; decode step "
        f"{', '.join(f'{v * 1e3:.1f} ms at batch {k}' for k, v in steps.items())} at {rates.get('decode_context')} "
        f"tokens of context; host->device {rates.get('h2d_gb_s', 0):.1f} GB/s, device->host "
        f"{rates.get('d2h_gb_s', 0):.1f} GB/s): bound = max(the configuration's prefill and decode work at those "
        "rates, the longest session's critical path with its think time). Then the mean per turn of the engine's "
        "timing record (Usage.timing), by cause."
    )
    keys = ["waiting_s", "swap_in_s", "recompute_s", "prefill_s", "decode_s", "decode_stall_s", "other_s"]
    table_rows = []
    for r in rows:
        b, mean = r["lower_bound"], (r.get("breakdown") or {}).get("mean_s", {})
        table_rows.append(
            {
                "config": r["config"],
                "makespan_s": r["makespan_s"],
                "work_s": b["work_s"],
                "critical_s": b["critical_path_s"],
                "bound_s": b["bound_s"],
                "ratio": r["makespan_over_bound"],
                **{k: mean.get(k, 0.0) * 1e3 for k in keys},
            }
        )
    cols = [
        ("config", "config"),
        ("makespan_s", "makespan s"),
        ("work_s", "work s"),
        ("critical_s", "critical path s"),
        ("bound_s", "bound s"),
        ("ratio", "makespan / bound"),
        ("waiting_s", "waiting ms"),
        ("swap_in_s", "swap-in ms"),
        ("recompute_s", "recompute ms"),
        ("prefill_s", "prefill ms"),
        ("decode_s", "decode ms"),
        ("decode_stall_s", "decode stalled by prefill ms"),
        ("other_s", "other ms"),
    ]
    return [head, table(table_rows, cols)]


def _breakdown_parts(rows: list[dict]) -> list[str]:
    keys = ["waiting_s", "swap_in_s", "recompute_s", "prefill_s", "decode_s", "decode_stall_s", "other_s"]
    table_rows = [
        {"config": r["config"], **{k: r["breakdown"].get("mean_s", {}).get(k, 0.0) * 1e3 for k in keys}} for r in rows
    ]
    cols = [("config", "config")] + [(k, k[:-2].replace("_", " ") + " ms") for k in keys]
    return ["Mean per turn of the engine's timing record (Usage.timing), by cause.", table(table_rows, cols)]


def selection_overhead_section(d: dict) -> str:
    cols = [
        ("method", "method"),
        ("budget", "budget"),
        ("batch", "batch"),
        ("context", "context"),
        ("step_ms", "step ms"),
        ("x_dense", "x dense"),
        ("device_pages_per_seq", "device pages/seq"),
        ("host_pages_per_seq", "host pages/seq"),
        ("fetched_pages_per_step", "fetched pages/step/seq"),
    ]
    return "\n\n".join(
        [
            "## Selection overhead (quest, omnikv, offload, duo_attention)",
            f"`benchmarks/selection_overhead.py` on {d['device']} ({d['backend']} backend, {d['model']}, page "
            f"{d['page_size']}): decode step time over synthetic KV next to dense in the same run, and where each "
            "sequence's pages sit at the end (offload: device pages stay at the budget, the rest on the host).",
            table(d["rows"], cols),
        ]
    )


def _pivot(rows: list[dict], metrics: list[tuple[str, str]]) -> tuple[list[dict], list[tuple[str, str]]]:
    """One row per method, one column per (budget, metric); a method without a budget (dense)
    shows its value under every budget, so each method sits next to dense."""
    budgets = sorted({r["budget_ratio"] for r in rows if r["budget_ratio"] is not None}, reverse=True)
    out: dict[str, dict] = {}
    for r in rows:
        row = out.setdefault(r["method"], {"method": r["method"]})
        for b in [r["budget_ratio"]] if r["budget_ratio"] is not None else budgets:
            for key, _ in metrics:
                row[f"{key}@{b}"] = r.get(key)
    cols = [("method", "method")] + [(f"{k}@{b}", f"{h} @ {b:.0%}") for b in budgets for k, h in metrics]
    return list(out.values()), cols


def quality_section(d: dict, name: str = "quality") -> str:
    parts = [
        f"## Quality next to dense ({name})",
        f"`{d.get('command', 'benchmarks/quality.py')}` on {d.get('device', '?')} ({d.get('model', '?')}), "
        f"{d.get('elapsed_s', 0) / 60:.0f} min. Budgets are fractions of the context kept per (layer, kv-head).",
    ]
    pk = d.get("passkey")
    if pk and pk.get("rows"):
        rows, cols = _pivot(pk["rows"], [("accuracy", "accuracy"), ("evicted_fraction", "evicted")])
        parts += [
            f"**(a) Passkey retrieval**: {pk['samples']} locally generated haystacks of ~{pk['context_tokens']} "
            "tokens, the key at a random depth, greedy answer; accuracy = answers containing the key, "
            "evicted = fraction of the prompt's KV freed.",
            table(rows, cols),
        ]
    ag = d.get("agreement")
    if ag and ag.get("rows"):
        modes = ag.get("modes", ["prefill"])
        metrics = []
        if "prefill" in modes:
            metrics += [("top1_agreement", "top-1 (prefill)"), ("mean_kl", "KL (prefill)")]
        if "decode" in modes:
            metrics += [("decode_top1_agreement", "top-1 (decode)"), ("decode_mean_kl", "KL (decode)")]
        rows, cols = _pivot(ag["rows"], metrics)
        parts += [
            f"**(b) Agreement with dense, teacher-forced**: {ag['segments']} segments of `{ag['text']}`, "
            f"{ag['context_tokens']} context tokens, then {ag['continuation_tokens']} continuation tokens; top-1 "
            "next-token agreement with dense and mean KL(dense || method) per position. (prefill): the context "
            "is a first turn the method compresses, the continuation a second turn prefilled through the "
            "compressed cache (the Chain Cache's path). (decode): the continuation goes through decode steps "
            "one token at a time, as generation reads the cache; decode-time methods (quest, omnikv, offload, "
            "h2o, rkv) act only here.",
            table(rows, cols),
        ]
    if d.get("note"):
        parts.append(d["note"])
    return "\n\n".join(parts)


# results file stem -> section renderer (files without one get a generic table)
RENDERERS = {
    "decode_throughput": decode_section,
    "decode_throughput_quest": lambda d: decode_section(d, "decode_throughput_quest"),
    "kernel_bandwidth": kernel_section,
    "agent_trace_cpu": lambda d: agent_trace_section(d, "agent_trace_cpu"),
    "agent_trace_gpu": lambda d: agent_trace_section(d, "agent_trace_gpu"),
    "reliability": reliability_section,
    "selection_overhead": selection_overhead_section,
    "quality_eviction": lambda d: quality_section(d, "eviction methods"),
    "quality_selection": lambda d: quality_section(d, "selection and quantization methods"),
    "quality_eviction_window16": lambda d: quality_section(
        d, "snapkv and pyramidkv with a 16-token observation window"
    ),
    "quant_quality": quant_section,
}


def _agent_quality(stem: str):
    return lambda d: agent_quality_report.section(d, stem)


RENDERERS.update({s: _agent_quality(s) for s in ("agent_quality_cpu", "agent_quality_gpu")})


def _agent_fidelity(stem: str):
    return lambda d: agent_fidelity_report.section(d, stem)


def main() -> None:
    parts = [
        "# Benchmarks",
        "Generated by `python benchmarks/report.py` from `benchmarks/results/*.json`; the scripts that "
        "produce each file are named in its section. Ratios are taken side by side within one run.",
    ]
    for path in sorted(RESULTS.glob("*.json")):
        d = json.loads(path.read_text())
        render = RENDERERS.get(path.stem)
        if render is None and path.stem.startswith("agent_trace") and "rows" in d and "trace" in d:
            render = lambda d, stem=path.stem: agent_trace_section(d, stem)  # noqa: E731
        if render is None and path.stem.startswith("agent_quality") and "calibration" in d:
            render = _agent_quality(path.stem)
        if render is None and path.stem.startswith("agent_fidelity") and "summary" in d:
            render = _agent_fidelity(path.stem)
        parts.append(render(d) if render else generic_section(path.stem, d))
    DOC.parent.mkdir(parents=True, exist_ok=True)
    DOC.write_text("\n\n".join(p for p in parts if p) + "\n")
    print(f"wrote {DOC.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
