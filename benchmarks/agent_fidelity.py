"""Agent fidelity: what a compressed chain keeps of dense, on 4-8K-token agent transcripts.

Transcripts (benchmarks/agent_transcripts.py): a coding agent's session, tool calls whose outputs are
the repository's own code, benchmark JSON, logs and docs as search results, then user questions about
earlier tool outputs (the files change with the repository, so the result records its ``commit``).
Dense on the chain writes the replies first; every configuration then runs the same transcript in
process (``LLMEngine.add_turn``), teacher-forced on the decode path to dense's replies
(benchmarks/fidelity_measures.py), and is measured against dense on the question turns:

  agreement         the share of reply positions where the configuration's argmax is dense's token
  attention recall  the share of dense's attention (reply queries over the context) on positions the
                    session holds at the turn's first decode step: on the device, and on the device
                    or in the recall tier's cold store (``+recall``)
  exact match       the question's answer in the free-running reply (known up to the first
                    disagreement with dense; SmolLM2-135M answers few of these at 4-8K tokens)

Configurations: ``dense`` (against its own free-running run: 1.0 unless numerics differ), every
eviction method (``holds_budget``) at each ``--budgets`` ratio, with and without ``+recall``, and
quest and omnikv (they keep every token: no recall variant). Budgets are ``budget_ratio``s: the
fraction of the context each (layer, kv-head) keeps as the chain grows. Each configuration's result is
saved (``--out``) as it finishes; a table is printed last; benchmarks/report.py renders the JSON.

    python benchmarks/agent_fidelity.py --size cpu   # 2 transcripts of 2K tokens, 5 configurations: 6 min idle,
                                                     # about an hour on 2 cores shared by 9 jobs
    bash benchmarks/agent_fidelity_gpu.sh $OUT                           # the H200, --size gpu
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.agent_transcripts import make_transcript  # noqa: E402
from benchmarks.fidelity_measures import (  # noqa: E402
    attention_recall,
    dense_attention,
    exact_match,
    run_dense,
    run_forced,
)
from engine.config import EngineConfig  # noqa: E402
from engine.method_spec import MethodSpec  # noqa: E402
from engine.llm import LLMEngine  # noqa: E402
from engine.methods.recall_variant import SUFFIX  # noqa: E402

EVICTION = (
    "snapkv",
    "kvzip",
    "streaming_llm",
    "expected_attention",
    "keydiff",
    "h2o",
    "tova",
    "pyramidkv",
    "adakv",
    "rkv",
)
"""The registry's methods that hold a budget, the ones measured first first."""
FULL_KV = ("quest", "omnikv")
"""Methods that keep every token (they select what attention reads): no recall variant."""
FIRST = ("snapkv", "kvzip", "streaming_llm", "expected_attention", "keydiff")


@dataclass(frozen=True)
class Preset:
    samples: int
    tokens: int
    steps: int
    questions: int
    answer_reply: int
    methods: tuple[str, ...]
    budgets: tuple[float, ...]
    step_reply: int = 8
    """Tokens dense may reply after each tool output (forced, not measured: fewer is faster)."""


PRESETS = {
    "tiny": Preset(1, 500, 2, 1, 8, ("streaming_llm",), (0.1,), step_reply=1),
    "cpu": Preset(2, 2000, 3, 2, 16, ("streaming_llm", "snapkv"), (0.1,), step_reply=1),
    "gpu": Preset(8, 7000, 6, 3, 48, EVICTION + FULL_KV, (0.25, 0.5, 0.1)),
}


@dataclass(frozen=True)
class Config:
    method: str
    budget: float | None = None
    recall: bool = False
    recall_args: tuple[tuple[str, object], ...] = ()
    """The recall variant's parameters (engine/methods/recall_variant.py), as ``(name, value)`` pairs."""

    @property
    def name(self) -> str:
        if self.method == "dense":
            return "dense"
        args = f"[{','.join(f'{k}={v}' for k, v in self.recall_args)}]" if self.recall_args else ""
        return f"{self.method}{SUFFIX if self.recall else ''}{args}@{self.budget:g}"

    def spec(self) -> MethodSpec:
        if self.method == "dense":
            return MethodSpec("dense")
        name = self.method + (SUFFIX if self.recall else "")
        return MethodSpec(name, budget_ratio=self.budget, method_args=dict(self.recall_args))


def build_configs(methods: list[str], budgets: list[float], recall_variants: list[dict] | None = None) -> list[Config]:
    """dense, then per budget (in the order given) the FIRST methods (X+recall once per entry of
    ``recall_variants``, then X), then the rest."""
    variants = [tuple(sorted(v.items())) for v in (recall_variants or [{}])]
    out = [Config("dense")]
    ordered = [m for m in FIRST if m in methods] + [m for m in methods if m not in FIRST]
    for b in budgets:
        for m in ordered:
            if m not in FULL_KV:
                out += [Config(m, b, recall=True, recall_args=v) for v in variants]
            out.append(Config(m, b))
    return out


def summarize_config(rows: list[dict]) -> dict:
    """Means over a configuration's question turns (agreement weighted by reply positions)."""
    pos = sum(r["positions"] for r in rows)
    return {
        "agreement": sum(r["agreed"] for r in rows) / max(1, pos),
        "attention_recall_device": sum(r["recall_device"] for r in rows) / len(rows),
        "attention_recall_held": sum(r["recall_held"] for r in rows) / len(rows),
        "exact_match": sum(r["correct"] for r in rows) / len(rows),
        "positions": pos,
        "questions": len(rows),
    }


def make_engine(args, max_model_len: int) -> LLMEngine:
    return LLMEngine(
        EngineConfig(
            model=args.model,
            device=args.device,
            dtype=args.dtype,
            max_model_len=max_model_len,
            prefill_chunk_size=args.prefill_chunk_size,
            max_num_batched_tokens=4 * args.prefill_chunk_size,
            max_num_seqs=max(8, args.samples),
            kv_cache_gb=args.kv_cache_gb,
            prefix_sharing=False,
            cuda_graphs=args.cuda_graphs,
        )
    )


def _commit() -> str | None:
    """The checkout's commit: the transcripts are built from the repository's own files, so a result
    is reproduced at the commit it was taken at (None outside a git checkout)."""
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def print_table(result: dict) -> None:
    print(f"{'config':<34} {'agree':>6} {'att dev':>8} {'att held':>8} {'EM':>5} {'KV':>5} {'cold':>5}")
    for s in result["summary"]:
        print(
            f"{s['config']:<34} {s['agreement']:6.3f} {s['attention_recall_device']:8.3f} "
            f"{s['attention_recall_held']:8.3f} {s['exact_match']:5.2f} {s['kv_fraction']:5.2f} {s['cold_fraction']:5.2f}"
        )


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="cpu", choices=sorted(PRESETS), help="a preset (below flags override it)")
    ap.add_argument("--methods", default=None, help="comma-separated (default: the preset's; 'all': every one)")
    ap.add_argument("--budgets", default=None, help="budget ratios, comma-separated (e.g. 0.5,0.25,0.1)")
    ap.add_argument("--samples", type=int, default=None, help="transcripts (seeds seed .. seed+samples-1)")
    ap.add_argument("--tokens", type=int, default=None, help="transcript length in tokens, replies included")
    ap.add_argument("--steps", type=int, default=None, help="tool calls per transcript")
    ap.add_argument("--questions", type=int, default=None, help="question turns per transcript")
    ap.add_argument(
        "--recall-variants",
        default="[{}]",
        help="a JSON list of recall parameter sets, one X+recall configuration each "
        "(e.g. '[{}, {\"recall_interval\": 1}]'; engine/methods/recall_variant.py lists them)",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--cuda-graphs", default="true")
    ap.add_argument("--prefill-chunk-size", type=int, default=2048)
    ap.add_argument("--kv-cache-gb", type=float, default=0.5, help="the KV pool (the GPU script gives 8)")
    ap.add_argument("--note", default="")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "agent_fidelity_cpu.json"))
    args = ap.parse_args(argv)
    p = PRESETS[args.size]
    args.samples = args.samples or p.samples
    tokens, steps, questions = args.tokens or p.tokens, args.steps or p.steps, args.questions or p.questions
    if args.methods == "all":
        methods = list(EVICTION + FULL_KV)
    else:
        methods = [m.strip() for m in args.methods.split(",") if m.strip()] if args.methods else list(p.methods)
    budgets = [float(b) for b in args.budgets.split(",") if b.strip()] if args.budgets else list(p.budgets)
    unknown = [m for m in methods if m not in EVICTION + FULL_KV]
    if unknown or not all(0 < b <= 1 for b in budgets):
        raise SystemExit(f"--methods takes {', '.join(EVICTION + FULL_KV)}; --budgets ratios in (0, 1]")
    variants = json.loads(args.recall_variants)
    if not isinstance(variants, list) or not all(isinstance(v, dict) for v in variants) or not variants:
        raise SystemExit('--recall-variants takes a non-empty JSON list of objects: [{}, {"recall_interval": 1}]')
    configs = build_configs(methods, budgets, variants)

    out_path = Path(args.out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    commit = _commit()  # before the transcripts are built from the repository's files
    engine = make_engine(args, 2 * tokens + 1024)  # kvzip's reconstruction pass reads the context twice
    count = lambda text: len(engine.encode(text))  # noqa: E731
    transcripts = [
        make_transcript(args.seed + i, tokens, count, steps, questions, p.step_reply, p.answer_reply)
        for i in range(args.samples)
    ]
    refs = run_dense(engine, transcripts)
    lengths = [len(r.history) for r in refs]
    masses = [dense_attention(engine, r) for r in refs]
    result = {
        "description": "benchmarks/agent_fidelity.py: agent transcripts (tool outputs of the repo's code, JSON, "
        "logs, docs) through the engine's chain API, each configuration teacher-forced to dense's replies.",
        "command": "python " + " ".join([Path(sys.argv[0]).as_posix()] + (argv if argv is not None else sys.argv[1:])),
        "commit": commit,
        "model": args.model,
        "size": args.size,
        "samples": args.samples,
        "seed": args.seed,
        "tokens": tokens,
        "steps": steps,
        "step_reply": p.step_reply,
        "answer_reply": p.answer_reply,
        "questions": questions,
        "budgets": budgets,
        "methods": methods,
        "recall_variants": variants,
        "note": args.note,
        "device": str(engine.device),
        "host": platform.processor() or platform.machine(),
        "torch_threads": torch.get_num_threads(),
        "mean_tokens": sum(lengths) / len(lengths),
        "dense_exact_match": sum(exact_match(engine, r, t) for r in refs for t in r.transcript.questions)
        / sum(len(r.transcript.questions) for r in refs),
        "rows": [],
        "summary": [],
        "skipped": [],
    }

    def save():
        result["elapsed_s"] = round(time.time() - t0, 1)
        out_path.write_text(json.dumps(result, indent=1) + "\n")

    print(
        f"{args.samples} transcripts, {result['mean_tokens']:.0f} tokens on average; dense exact match "
        f"{result['dense_exact_match']:.2f} ({time.time() - t0:.0f} s)",
        flush=True,
    )
    save()
    for cfg in configs:
        t1 = time.time()
        try:
            measures = run_forced(engine, refs, cfg.spec())
        except Exception as e:  # one configuration's failure is reported, the others still run
            result["skipped"].append({"config": cfg.name, "error": repr(e)[:500]})
            print(f"{cfg.name:<34} failed: {e!r}", flush=True)
            save()
            continue
        rows = []
        for i, (ref, m) in enumerate(zip(refs, measures)):
            for t in ref.transcript.questions:
                held = m.held[t]
                rows.append(
                    {
                        "config": cfg.name,
                        "sample": i,
                        "turn": t,
                        "kind": ref.transcript.turns[t].kind,
                        "positions": len(m.agree[t]),
                        "agreed": sum(m.agree[t]),
                        "recall_device": attention_recall(masses[i][t], held.device),
                        "recall_held": attention_recall(masses[i][t], held.device | held.cold),
                        "correct": exact_match(engine, ref, t, m.argmax[t]),
                    }
                )
        result["rows"] += rows
        summary = {
            "config": cfg.name,
            "method": cfg.method,
            "budget": cfg.budget,
            "recall": cfg.recall,
            "recall_args": dict(cfg.recall_args),
            **summarize_config(rows),
            "kv_fraction": sum(m.kv_fraction for m in measures) / len(measures),
            "cold_fraction": sum(m.cold_fraction for m in measures) / len(measures),
            "seconds": round(time.time() - t1, 1),
        }
        result["summary"].append(summary)
        save()
        s = summary
        print(
            f"{cfg.name:<34} agree {s['agreement']:.3f}  attention recall {s['attention_recall_device']:.3f} device, "
            f"{s['attention_recall_held']:.3f} held  EM {s['exact_match']:.2f}  KV {s['kv_fraction']:.2f} "
            f"cold {s['cold_fraction']:.2f}  ({s['seconds']:.0f} s)",
            flush=True,
        )
    print_table(result)
    return result


if __name__ == "__main__":
    main()
