"""Render docs/benchmarks.md from the committed results (benchmarks/results/*.json).

Each benchmark script saves JSON; this turns every result file it knows into a section with a
table, so the numbers in the docs are always the committed ones.

    python benchmarks/report.py
"""

from __future__ import annotations

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
DOC = ROOT / "docs" / "benchmarks.md"


def _fmt(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 100 else f"{v:,.0f}"
    return str(v)


def table(rows: list[dict], cols: list[tuple[str, str]]) -> str:
    out = ["| " + " | ".join(h for _, h in cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        out.append("| " + " | ".join(_fmt(r.get(k)) for k, _ in cols) + " |")
    return "\n".join(out)


def decode_section(d: dict) -> str:
    cols = [("method", "method"), ("batch", "batch"), ("context", "context"), ("budget", "budget"),
            ("kv", "KV"), ("kv_tokens_per_head", "KV tokens/head"), ("tokens_per_s", "tokens/s"),
            ("step_ms", "step ms"), ("roofline_fraction", "roofline"), ("ratio_vs_dense", "x dense (largest batch)"),
            ("ratio_vs_dense_same_batch", "x dense (same batch)"), ("hf_step_ms", "HF step ms"),
            ("ratio_vs_hf", "x HF"), ("prefill_s", "prefill s")]
    hf = d.get("hf_step_ms") or {}
    hf_line = ", ".join(f"batch {b}: {ms:.1f} ms" for b, ms in sorted(hf.items(), key=lambda x: int(x[0]))) or "not run"
    return "\n\n".join([
        "## Decode throughput (GPU)",
        f"`benchmarks/decode_throughput.py` on {d['device']}, {d['shape']} shapes, random bf16 weights; "
        f"measured copy bandwidth {d['copy_bandwidth_tb_s']:.2f} TB/s. Our dense engine fits {d['dense_largest_batch']} "
        f"sequences at this context. HF transformers (its own model and DynamicCache, sdpa), same run: {hf_line}.",
        "`roofline` = (weights + KV bytes a step must read) / (copy bandwidth x step time). " + d.get("note", ""),
        table(d["rows"], cols),
        "![decode throughput](../benchmarks/results/decode_throughput.png)",
    ])


def kernel_section(d: dict) -> str:
    cols = [("kernel", "kernel"), ("batch", "batch"), ("context", "context"), ("page_size", "page"),
            ("block_t", "BLOCK_T"), ("num_warps", "warps"), ("num_stages", "stages"), ("splits", "splits"),
            ("ms", "ms"), ("tb_s", "TB/s"), ("fraction", "of copy bw")]
    return "\n\n".join([
        "## Paged decode kernel vs the bandwidth roofline",
        f"`benchmarks/kernel_bandwidth.py` on {d['device']} (copy bandwidth {d['copy_bandwidth_tb_s']:.2f} TB/s): one "
        "decode-attention call over scattered head-granular pages (8 kv-heads, GQA 4, head_dim 128, bf16) next to "
        "SDPA on contiguous KV.",
        table(d["rows"], cols),
    ])


def generic_section(name: str, d: dict) -> str:
    rows = d.get("rows") or d.get("results") or []
    if not rows or not isinstance(rows, list) or not isinstance(rows[0], dict):
        return f"## {name}\n\nSee `benchmarks/results/{name}.json`."
    cols = [(k, k) for k in rows[0] if not isinstance(rows[0][k], (list, dict))]
    intro = d.get("description") or d.get("note") or ""
    return "\n\n".join([f"## {name}", intro, table(rows, cols)])


def _pivot(rows: list[dict], metrics: list[tuple[str, str]]) -> tuple[list[dict], list[tuple[str, str]]]:
    """One row per method, one column per (budget, metric); a method without a budget (dense)
    shows its value under every budget, so each method sits next to dense."""
    budgets = sorted({r["budget_ratio"] for r in rows if r["budget_ratio"] is not None}, reverse=True)
    out: dict[str, dict] = {}
    for r in rows:
        row = out.setdefault(r["method"], {"method": r["method"]})
        for b in ([r["budget_ratio"]] if r["budget_ratio"] is not None else budgets):
            for key, _ in metrics:
                row[f"{key}@{b}"] = r.get(key)
    cols = [("method", "method")] + [(f"{k}@{b}", f"{h} @ {b:.0%}") for b in budgets for k, h in metrics]
    return list(out.values()), cols


def quality_section(d: dict, name: str = "quality") -> str:
    parts = [f"## Quality next to dense ({name})",
             f"`{d.get('command', 'benchmarks/quality.py')}` on {d.get('device', '?')} ({d.get('model', '?')}), "
             f"{d.get('elapsed_s', 0) / 60:.0f} min. Budgets are fractions of the context kept per (layer, kv-head)."]
    pk = d.get("passkey")
    if pk and pk.get("rows"):
        rows, cols = _pivot(pk["rows"], [("accuracy", "accuracy"), ("evicted_fraction", "evicted")])
        parts += [f"**(a) Passkey retrieval**: {pk['samples']} locally generated haystacks of ~{pk['context_tokens']} "
                  "tokens, the key at a random depth, greedy answer; accuracy = answers containing the key, "
                  "evicted = fraction of the prompt's KV freed.", table(rows, cols)]
    ag = d.get("agreement")
    if ag and ag.get("rows"):
        rows, cols = _pivot(ag["rows"], [("top1_agreement", "top-1 agreement"), ("mean_kl", "mean KL")])
        parts += [f"**(b) Agreement with dense, teacher-forced**: {ag['segments']} segments of `{ag['text']}`, "
                  f"{ag['context_tokens']} context tokens compressed as a first turn, then {ag['continuation_tokens']} "
                  "continuation tokens fed through the compressed cache; top-1 next-token agreement with dense and "
                  "mean KL(dense || method) per position.", table(rows, cols)]
    if d.get("note"):
        parts.append(d["note"])
    return "\n\n".join(parts)


RENDERERS = {"decode_throughput": decode_section, "kernel_bandwidth": kernel_section,
             "quality_eviction": lambda d: quality_section(d, "eviction methods"),
             "quality_selection": lambda d: quality_section(d, "selection and quantization methods")}


def main() -> None:
    parts = ["# Benchmarks",
             "Generated by `python benchmarks/report.py` from `benchmarks/results/*.json`; the scripts that "
             "produce each file are named in its section. Ratios are taken side by side within one run."]
    for path in sorted(RESULTS.glob("*.json")):
        d = json.loads(path.read_text())
        render = RENDERERS.get(path.stem)
        parts.append(render(d) if render else generic_section(path.stem, d))
    DOC.parent.mkdir(parents=True, exist_ok=True)
    DOC.write_text("\n\n".join(p for p in parts if p) + "\n")
    print(f"wrote {DOC.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
