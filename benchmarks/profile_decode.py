"""Where a decode step's time goes: host work vs the CUDA-graph replay vs kernels (eager profile).

    python benchmarks/profile_decode.py --batch 1 26 --context 32768
    python benchmarks/profile_decode.py --method quest --batch 4    # a sparse method's decode step

For each batch: the step's wall time and its CUDA-graph replay time, the host<->device syncs one
eager step makes (torch's sync debug mode, counted by source line) and the kernels of one eager
step.
"""

from __future__ import annotations

import argparse
import collections
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.decode_throughput import METHOD_SPECS, write_config  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.llm import LLMEngine  # noqa: E402
from engine.sampling import SamplingParams  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="llama-3.1-8b")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 26])
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument(
        "--kv", type=int, default=None, help="KV tokens per head (default: the context; a method: what it keeps)"
    )
    ap.add_argument("--method", default="dense", choices=["dense", *METHOD_SPECS])
    ap.add_argument("--budget", type=int, default=2048)
    args = ap.parse_args()
    cfg_dir = write_config(args.shape, args.context)
    engine = LLMEngine(
        EngineConfig(
            model=cfg_dir,
            page_size=32,
            max_model_len=args.context + 1024,
            max_num_seqs=512,
            gpu_memory_utilization=0.93,
        ),
        random_weights=True,
    )
    spec = None if args.method == "dense" else METHOD_SPECS[args.method].spec(args.budget)
    kv = args.kv or (
        args.context - 1 if spec is None else engine.controller.method_for(spec).kept_tokens(args.context - 1)
    )
    graphs = engine.runner.graphs
    for B in args.batch:
        rids = [
            engine.add_prefilled_request(
                args.context, kv, SamplingParams(max_tokens=64, ignore_eos=True), method=spec, seed=i
            )
            for i in range(B)
        ]
        for _ in range(3):
            engine.step()
        run = graphs.run
        replay_ms = []

        def timed_run(*a, **k):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            out = run(*a, **k)
            e.record()
            e.synchronize()
            replay_ms.append(s.elapsed_time(e))
            return out

        graphs.run = timed_run
        step_ms = []
        for _ in range(10):
            t0 = time.perf_counter()
            engine.step()
            step_ms.append(1e3 * (time.perf_counter() - t0))
        graphs.run = run
        med = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
        if replay_ms:
            print(
                f"{args.method} B={B}: step {med(step_ms):.2f} ms, graph replay {med(replay_ms):.2f} ms, host {med(step_ms) - med(replay_ms):.2f} ms"
            )
        else:
            print(f"{args.method} B={B}: step {med(step_ms):.2f} ms, run eagerly (no CUDA graph replay)")
        # eager step under torch's sync debug mode: where the host waits for the device
        engine.runner.graphs = None
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                engine.step()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        where = collections.Counter(
            f"{Path(w.filename).name}:{w.lineno}" for w in caught if "synchroniz" in str(w.message)
        )
        print(
            f"  {sum(where.values())} syncs in one eager step: "
            + ", ".join(f"{k} x{n}" for k, n in where.most_common(12))
        )
        # eager profile of one step: which kernels take the time
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            engine.step()
            torch.cuda.synchronize()
        engine.runner.graphs = graphs
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=60))
        for r in rids:
            engine.abort(r)


if __name__ == "__main__":
    main()
