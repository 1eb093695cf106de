"""Decode throughput under tensor parallelism: a Llama-3.1-70B-shaped random model over N GPUs.

The same rows and roofline columns as benchmarks/decode_throughput.py (dense, and snapkv with a
2,048-token budget, each at its largest batch, decoding from synthetically filled KV at a 32K
context), on an engine whose model and kv-heads are split over ``--tp`` ranks (one process per GPU,
NCCL). The roofline is per GPU: the bytes one rank reads per step (its shard of the weights and the
K/V of its own kv-heads) against that GPU's copy bandwidth; every rank reads the same amount.

    python benchmarks/decode_throughput_tp.py --tp 2 --out benchmarks/results/decode_throughput_tp2.json

Needs ``--tp`` GPUs of one host. Rank 0 measures and writes the results; the other ranks follow it.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from benchmarks import decode_throughput as single  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.tensor_parallel.launcher import launch  # noqa: E402

SHAPES = {
    "llama-3.1-70b": dict(
        hidden_size=8192,
        intermediate_size=28672,
        num_hidden_layers=80,
        num_attention_heads=64,
        num_key_value_heads=8,
        vocab_size=128256,
        tie_word_embeddings=False,
    ),
    **single.SHAPES,
}


def bench(engine, args: argparse.Namespace) -> None:
    """Rank 0: the dense and method rows of decode_throughput.py on the replicated engine."""
    ctx, steps = args.context, args.steps
    bw = single.copy_bandwidth(1 << 30)
    print(f"{torch.cuda.get_device_name(0)} x{args.tp}: copy bandwidth {bw / 1e12:.2f} TB/s per GPU", flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []
    dense_max = single.max_batch(engine, ctx, steps)
    print(f"pool {engine.pool.num_pages} pages per rank; dense fits {dense_max} at {ctx}", flush=True)
    for B in sorted({1, 4, dense_max}):
        if 1 <= B <= dense_max:
            rows.append(single.synthetic_row(engine, "dense", None, B, ctx, ctx - 1, steps, bw))
            _finish(args, bw, dense_max, rows, out)
            print(
                f"  dense batch {B}: {rows[-1]['step_ms']:.2f} ms/step, {rows[-1]['tokens_per_s']:.0f} tok/s, "
                f"roofline {rows[-1]['roofline_fraction']:.2f}",
                flush=True,
            )
    for m in [m for m in args.methods.split(",") if m]:
        spec = single.METHOD_SPECS[m].spec(args.budget)
        kept = engine.controller.method_for(spec).kept_tokens(ctx - 1)
        kv = single.METHOD_SPECS[m].head_lengths(engine, kept, ctx)
        B = single.max_batch(engine, kept, steps)
        for batch in sorted({B, 4, dense_max}, reverse=True):
            if 1 <= batch <= B:
                rows.append(single.synthetic_row(engine, m, spec, batch, ctx, kv, steps, bw))
                _finish(args, bw, dense_max, rows, out)
                print(
                    f"  {m} batch {batch}: {rows[-1]['step_ms']:.2f} ms/step, {rows[-1]['tokens_per_s']:.0f} tok/s, "
                    f"roofline {rows[-1]['roofline_fraction']:.2f}",
                    flush=True,
                )
    result = _finish(args, bw, dense_max, rows, out)
    print(f"\n{'method':<10}{'batch':>6}{'tok/s':>10}{'ms':>8}{'roof':>6}{'x dense':>9}{'x same B':>9}")
    for r in result["rows"]:
        same = f"{r['ratio_vs_dense_same_batch']:.2f}" if r["ratio_vs_dense_same_batch"] else "-"
        print(
            f"{r['method']:<10}{r['batch']:>6}{r['tokens_per_s']:>10.0f}{r['step_ms']:>8.2f}"
            f"{r['roofline_fraction']:>6.2f}{r['ratio_vs_dense']:>9.2f}{same:>9}"
        )


def _finish(args, bw, dense_max, rows, out) -> dict:
    result = single.finish(args, bw, dense_max, {}, rows, out)
    result.update(tensor_parallel_size=args.tp, roofline="per GPU: one rank's weight shard and kv-heads")
    out.write_text(__import__("json").dumps(result, indent=1))
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--shape", default="llama-3.1-70b", choices=sorted(SHAPES))
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--budget", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--methods", default="snapkv")
    ap.add_argument("--max-num-seqs", type=int, default=512)
    ap.add_argument("--out", default="benchmarks/results/decode_throughput_tp.json")
    args = ap.parse_args()
    if torch.cuda.device_count() < args.tp:
        print(f"--tp {args.tp} needs {args.tp} GPUs; {torch.cuda.device_count()} visible", file=sys.stderr)
        return 2
    single.SHAPES.update(SHAPES)  # write_config reads the shape table of decode_throughput.py
    cfg_dir = single.write_config(args.shape, args.context)
    config = EngineConfig(
        model=cfg_dir,
        page_size=32,
        max_model_len=args.context + 1024,
        max_num_seqs=args.max_num_seqs,
        gpu_memory_utilization=0.93,
        prefill_chunk_size=4096,
        max_num_batched_tokens=4096,
        tensor_parallel_size=args.tp,
    )
    return launch(config, bench, args, random_weights=True)


if __name__ == "__main__":
    sys.exit(main())
