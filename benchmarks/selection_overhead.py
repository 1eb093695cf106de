"""Selection overhead: decode step time of the query-aware and offload methods against dense.

Each method decodes ``--steps`` steps for ``--batch`` sequences whose caches hold ``--context``
tokens of synthetic KV (whatever the pool's pages hold; the tokens are random), so the number is
the cost of the method's work per step (page summaries, scoring, top-k, host transfers) plus the
attention it leaves, not quality. Also reports the device pages each sequence holds at the end and,
for offload, the host pages and the pages fetched per step.

    python benchmarks/selection_overhead.py --out benchmarks/results/selection_overhead.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from engine.config import EngineConfig  # noqa: E402
from engine.method_spec import MethodSpec  # noqa: E402
from engine.llm import LLMEngine  # noqa: E402
from engine.sampling import SamplingParams  # noqa: E402

METHODS = ("dense", "quest", "omnikv", "offload", "duo_attention")


def run(engine: LLMEngine, spec: MethodSpec, batch: int, context: int, steps: int) -> dict:
    sp = SamplingParams(max_tokens=steps + 2, ignore_eos=True)
    ids = [engine.add_prefilled_request(context, context - 1, sp, method=spec, seed=i) for i in range(batch)]
    engine.step()  # the first step builds the summaries from the cache (and moves cold pages out)
    host = engine.pool.host if engine.pool.has_host else None
    fetched0 = host.fetches if host else 0
    if engine.device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    if engine.device.type == "cuda":
        torch.cuda.synchronize()
    step_ms = (time.perf_counter() - t0) / steps * 1e3
    row = {
        "method": spec.method,
        "budget": spec.budget,
        "batch": batch,
        "context": context,
        "step_ms": step_ms,
        "device_pages_per_seq": engine.manager.num_pages(ids[0]),
        "host_pages_per_seq": sum(
            engine.manager.num_host_pages(ids[0], layer) for layer in range(engine.shape.num_layers)
        ),
        "fetched_pages_per_step": ((host.fetches - fetched0) / steps / batch) if host else 0.0,
    }
    for rid in ids:
        engine.abort(rid)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument(
        "--random-weights",
        action="store_true",
        help="real shapes, random weights (a folder with config.json is enough)",
    )
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--budget", type=int, default=256)
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "selection_overhead.json"))
    args = ap.parse_args()
    engine = LLMEngine(
        EngineConfig(
            model=args.model,
            max_model_len=args.context + args.steps + 8,
            prefill_chunk_size=512,
            cuda_graphs=False,
            async_decode=False,
        ),
        random_weights=args.random_weights,
    )
    rows = []
    for name in args.methods.split(","):
        spec = MethodSpec(name) if name == "dense" else MethodSpec(name, budget=args.budget)
        rows.append(run(engine, spec, args.batch, args.context, args.steps))
        print(json.dumps(rows[-1]), flush=True)
    dense = next((r["step_ms"] for r in rows if r["method"] == "dense"), None)
    for r in rows:
        r["x_dense"] = r["step_ms"] / dense if dense else None
    result = {
        "device": torch.cuda.get_device_name() if engine.device.type == "cuda" else "cpu",
        "model": engine.model_dir.name,
        "backend": engine.backend.name,
        "page_size": engine.config.page_size,
        "threads": torch.get_num_threads(),
        "rows": rows,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
