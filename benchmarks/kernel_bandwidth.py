"""Paged decode kernel vs the bandwidth roofline, side by side with SDPA on contiguous KV.

For each (batch, context, page size, kernel variant) it times one decode-attention call (median of
CUDA-event timings over rotated inputs), counts the bytes it must read (K and V of every token
plus q) and reports TB/s and the fraction of the measured copy bandwidth. Writes JSON.

    python benchmarks/kernel_bandwidth.py --out benchmarks/results/kernel_bandwidth.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.attention.triton_paged import num_splits, paged_decode  # noqa: E402


def copy_bandwidth(nbytes: int = 4 << 30) -> float:
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    t = time_ms(lambda: dst.copy_(src), iters=20)
    return 2 * nbytes / (t * 1e-3)


def time_ms(fn, iters: int = 30) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(iters):
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def bench_paged(B, ctx, H, G, D, P, variant, sms, sets=2):
    pages_per_head = ctx // P
    n_pages = B * H * pages_per_head
    pools = []
    for _ in range(sets):  # rotate input sets so repeated runs do not read from L2
        k = torch.empty(n_pages, P, D, dtype=torch.bfloat16, device="cuda").normal_()
        v = torch.empty_like(k).normal_()
        perm = torch.randperm(n_pages, device="cuda").to(torch.int32)  # scattered pages
        tables = perm.view(B, H, pages_per_head)
        pools.append((k, v, tables))
    lengths = torch.full((B, H), ctx, dtype=torch.int32, device="cuda")
    rows = torch.arange(B, dtype=torch.int32, device="cuda")
    q = torch.randn(B, H * G, D, dtype=torch.bfloat16, device="cuda")
    bt, warps, stages = variant
    splits = num_splits(B * H, ctx, sms, bt)
    i = [0]

    def run():
        k, v, t = pools[i[0] % sets]
        i[0] += 1
        paged_decode(q, k, v, t, lengths, rows, D**-0.5, splits=splits, block_t=bt, num_warps=warps, num_stages=stages)

    for _ in range(3):
        run()
    ms = time_ms(run)
    nbytes = 2 * B * H * ctx * D * 2 + q.numel() * 2
    pools.clear()
    return ms, nbytes, splits


def bench_sdpa(B, ctx, H, G, D):
    k = torch.empty(B, H, ctx, D, dtype=torch.bfloat16, device="cuda").normal_()
    v = torch.empty_like(k).normal_()
    q = torch.randn(B, H * G, 1, D, dtype=torch.bfloat16, device="cuda")
    fn = lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)  # noqa: E731
    for _ in range(3):
        fn()
    ms = time_ms(fn)
    return ms, 2 * B * H * ctx * D * 2


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default="benchmarks/results/kernel_bandwidth.json")
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    bw = copy_bandwidth()
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s on {torch.cuda.get_device_name(0)}")
    H, G, D = 8, 4, 128
    shapes = [(64, 32768)] if args.quick else [(1, 32768), (8, 32768), (64, 32768), (256, 2048)]
    variants = [(64, 4, 2), (128, 4, 2), (128, 8, 3), (64, 4, 3)]
    rows = []
    for B, ctx in shapes:
        ms, nbytes = bench_sdpa(B, ctx, H, G, D)
        rows.append(
            {
                "kernel": "sdpa_contiguous",
                "batch": B,
                "context": ctx,
                "ms": ms,
                "tb_s": nbytes / ms / 1e9,
                "fraction": nbytes / (ms * 1e-3) / bw,
            }
        )
        for P in (16, 32, 64):
            for variant in variants:
                if variant[0] < P:
                    continue
                ms, nbytes, splits = bench_paged(B, ctx, H, G, D, P, variant, sms)
                rows.append(
                    {
                        "kernel": "paged",
                        "batch": B,
                        "context": ctx,
                        "page_size": P,
                        "block_t": variant[0],
                        "num_warps": variant[1],
                        "num_stages": variant[2],
                        "splits": splits,
                        "ms": ms,
                        "tb_s": nbytes / ms / 1e9,
                        "fraction": nbytes / (ms * 1e-3) / bw,
                    }
                )
        torch.cuda.empty_cache()
    print(f"{'kernel':<16}{'B':>5}{'ctx':>7}{'P':>4}{'BT':>5}{'w':>3}{'st':>3}{'ms':>9}{'TB/s':>7}{'frac':>6}")
    for r in rows:
        print(
            f"{r['kernel']:<16}{r['batch']:>5}{r['context']:>7}{r.get('page_size', ''):>4}{r.get('block_t', ''):>5}"
            f"{r.get('num_warps', ''):>3}{r.get('num_stages', ''):>3}{r['ms']:>9.3f}{r['tb_s']:>7.2f}{r['fraction']:>6.2f}"
        )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(
        json.dumps({"device": torch.cuda.get_device_name(0), "copy_bandwidth_tb_s": bw / 1e12, "rows": rows}, indent=1)
    )


if __name__ == "__main__":
    main()
