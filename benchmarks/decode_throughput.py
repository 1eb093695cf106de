"""Decode throughput on the GPU: our dense engine vs HF transformers vs the roofline, and sparse
methods at their own largest batch and at matched concurrency.

Random bf16 weights with real shapes (Llama-3.1-8B by default). Decode windows start from
synthetically filled KV (the pool's pages hold random values; each sequence's cache holds what the
method itself says it keeps, ``SparseMethod.kept_tokens``: 2,048 tokens per head for an evicting
method with a 2,048 budget, the whole context for quest, which evicts nothing and gains by reading
fewer pages) unless a row says ``real_prefill``: those prefill a real prompt through the engine,
let the method compress, then decode. Each method runs at its own largest batch (for quest that is
dense's) and at batch 4 (matched concurrency); ``ratio_vs_dense_same_batch`` compares it with dense
at the same batch. Every ratio is taken inside this one run.

    python benchmarks/decode_throughput.py --out benchmarks/results/decode_throughput.json
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from engine.config import EngineConfig  # noqa: E402
from engine.method_spec import MethodSpec  # noqa: E402
from engine.llm import LLMEngine  # noqa: E402
from engine.methods import REGISTRY  # noqa: E402
from engine.sampling import SamplingParams  # noqa: E402

SHAPES = {
    "llama-3.1-8b": dict(
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
        tie_word_embeddings=False,
    ),
    "tiny": dict(
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
        vocab_size=1024,
        tie_word_embeddings=False,
    ),
    # the 8B's layer and kv-head structure (32 layers x 8 kv-heads, GQA 4) at a width a CPU runs: for
    # profiling the engine's per-layer, per-head host work (benchmarks/agent_trace.py --profile)
    "thin-32l": dict(
        hidden_size=512,
        intermediate_size=1024,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=1024,
        tie_word_embeddings=False,
    ),
    "llama-3.2-1b": dict(
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
        tie_word_embeddings=True,
    ),
}


def uniform_lengths(engine: LLMEngine, kept: int, ctx: int) -> int:
    """Every (layer, kv-head) of a synthetic row holds the ``kept`` tokens the method keeps per head."""
    return kept


def adakv_lengths(engine: LLMEngine, budget: int, seed: int = 0) -> torch.Tensor:
    """Per-head counts like Ada-KV leaves them: uneven across heads, floor 20% of the budget, each layer
    summing to num_kv_heads * budget."""
    L, H = engine.shape.num_layers, engine.shape.num_kv_heads
    g = torch.Generator().manual_seed(seed)
    w = torch.rand(L, H, generator=g) + 0.2
    floor = int(0.2 * budget)
    spare = H * budget - H * floor
    extra = (w / w.sum(-1, keepdim=True) * spare).floor().long()
    extra[:, 0] += spare - extra.sum(-1)
    return floor + extra


def adaptive_lengths(engine: LLMEngine, kept: int, ctx: int) -> torch.Tensor:
    """Ada-KV's uneven split of the ``kept`` tokens per head (``adakv_lengths``), none past the context."""
    return adakv_lengths(engine, kept).clamp(max=ctx - 1)


def all_tokens(lengths: torch.Tensor, spec: MethodSpec | None, page_size: int) -> int:
    """K/V tokens a decode step reads from a sequence whose heads hold ``lengths`` ``[L, H]``: all of them."""
    return int(lengths.sum())


def quest_tokens(lengths: torch.Tensor, spec: MethodSpec, page_size: int) -> int:
    """What a quest step reads, in K/V-token equivalents: everything in its first ``dense_layers``
    layers; in the others its ``budget / page_size`` pages per head (sink and recent included) plus
    every page's bounds (a min and a max row of D: the bytes of one token's K and V)."""
    from engine.methods.quest import QuestParams

    p = QuestParams(**spec.method_args)
    dense, sparse = lengths[: p.dense_layers], lengths[p.dense_layers :].long()
    pages = (sparse + page_size - 1) // page_size
    k = max(-(-spec.budget // page_size), p.n_sink_pages + p.n_recent_pages)
    read = torch.minimum(sparse, pages.clamp(max=k) * page_size)
    return int(dense.sum()) + int(read.sum()) + int(pages.sum())


@dataclass(frozen=True)
class BenchMethod:
    """A method as this benchmark runs it. ``spec(budget)``: its MethodSpec for a token budget (2,048 by
    default), with any extra method args; ``head_lengths(engine, kept, ctx)``: the per-(layer, kv-head)
    cache lengths a synthetic row fills, given the ``kept`` tokens per head the method reports
    (``SparseMethod.kept_tokens``): an int (every head alike) or an ``[L, H]`` tensor;
    ``read_tokens(lengths, spec, page_size)``: the K/V a decode step reads from such a cache (the
    roofline's bytes): all of it, except for a method that selects what it reads."""

    spec: Callable[[int], MethodSpec]
    head_lengths: Callable[[LLMEngine, int, int], int | torch.Tensor] = uniform_lengths
    read_tokens: Callable[[torch.Tensor, MethodSpec | None, int], int] = all_tokens


METHOD_SPECS = {
    "snapkv": BenchMethod(lambda b: MethodSpec("snapkv", budget=b)),
    "quest": BenchMethod(lambda b: MethodSpec("quest", budget=b), read_tokens=quest_tokens),
    "streaming_llm": BenchMethod(lambda b: MethodSpec("streaming_llm", budget=b, method_args={"slack": 32})),
    "adakv": BenchMethod(lambda b: MethodSpec("adakv", budget=b), head_lengths=adaptive_lengths),
}


def write_config(shape: str, max_len: int) -> str:
    from transformers import LlamaConfig

    d = tempfile.mkdtemp(prefix=f"{shape}-")
    cfg = LlamaConfig(
        **SHAPES[shape],
        max_position_embeddings=131072,
        rms_norm_eps=1e-5,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    )
    cfg.architectures = ["LlamaForCausalLM"]
    cfg.save_pretrained(d)
    return d


def copy_bandwidth(nbytes: int = 4 << 30) -> float:
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(20):
        dst.copy_(src)
    torch.cuda.synchronize()
    bw = 2 * nbytes * 20 / (time.perf_counter() - t0)
    del src, dst
    torch.cuda.empty_cache()
    return bw


# --- HF transformers ---------------------------------------------------------------------------


def hf_decode(config_dir: str, batches: list[int], ctx: int, steps: int) -> dict[int, float]:
    """Step time (ms) of HF's own model and DynamicCache (sdpa) per batch; skips what does not fit."""
    from transformers import AutoConfig, DynamicCache, LlamaForCausalLM

    cfg = AutoConfig.from_pretrained(config_dir)
    cfg._attn_implementation = "sdpa"
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        model = LlamaForCausalLM(cfg).eval()
    torch.set_default_dtype(torch.float32)
    L, H, D = cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads
    out = {}
    for B in batches:
        per_seq = L * H * (ctx + steps + 4) * D * 2 * 2
        free, _ = torch.cuda.mem_get_info()
        if B * per_seq * 1.08 + 4e9 > free:
            print(f"  hf batch {B}: does not fit ({B * per_seq / 1e9:.0f} GB of KV)")
            continue
        cache = DynamicCache()
        for layer in range(L):
            cache.update(
                torch.randn(B, H, ctx, D, dtype=torch.bfloat16, device="cuda"),
                torch.randn(B, H, ctx, D, dtype=torch.bfloat16, device="cuda"),
                layer,
            )
        tok = torch.randint(0, cfg.vocab_size, (B, 1), device="cuda")
        times = []
        with torch.inference_mode():
            for i in range(steps + 2):
                pos = torch.full((B, 1), ctx + i, device="cuda")
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                logits = model(input_ids=tok, past_key_values=cache, position_ids=pos, use_cache=True).logits
                tok = logits[:, -1].argmax(-1, keepdim=True)
                torch.cuda.synchronize()
                times.append(time.perf_counter() - t0)
        out[B] = 1e3 * sorted(times[2:])[len(times[2:]) // 2]
        print(f"  hf batch {B}: {out[B]:.1f} ms/step")
        del cache, logits
        gc.collect()
        torch.cuda.empty_cache()
    del model
    gc.collect()
    torch.cuda.empty_cache()
    return out


# --- ours --------------------------------------------------------------------------------------


def weight_bytes(engine: LLMEngine, batch: int) -> int:
    total = sum(p.numel() * p.element_size() for p in engine.model.parameters())
    emb = engine.model.embed_tokens.weight
    if engine.model.lm_head is not None:  # the input embedding table is read only for the batch's rows
        total -= emb.numel() * emb.element_size() - batch * emb.shape[1] * emb.element_size()
    return total


def kv_bytes(engine: LLMEngine, rids, read: Callable = all_tokens, spec: MethodSpec | None = None) -> int:
    """Bytes of K/V a decode step of ``rids`` reads (``read``: a BenchMethod's ``read_tokens``)."""
    D = engine.model_config.head_dim
    elem = engine.pool.k.element_size()
    P = engine.manager.page_size
    return sum(read(engine.manager.seq_lengths(r), spec, P) for r in rids) * D * 2 * elem


def read_rule(method: str) -> Callable:
    return METHOD_SPECS[method].read_tokens if method in METHOD_SPECS else all_tokens


def max_batch(engine: LLMEngine, kv_tokens: int, steps: int) -> int:
    per = engine.scheduler.fresh_pages(kv_tokens + steps + 8)
    return max(0, min(engine.config.max_num_seqs, (engine.pool.num_free - 64) // per))


def timed_decode(engine: LLMEngine, rids, steps: int) -> float:
    for _ in range(3):  # warm-up: graphs for this bucket get captured here
        engine.step()
    torch.cuda.synchronize()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.step()  # reads the sampled tokens: the host waits for the step
        times.append(time.perf_counter() - t0)
    return 1e3 * sorted(times)[len(times) // 2]


def synthetic_row(engine, method: str, spec: MethodSpec | None, batch: int, ctx: int, kv, steps: int, bw: float):
    params = SamplingParams(max_tokens=steps + 16, ignore_eos=True)
    rids = [engine.add_prefilled_request(ctx, kv, params, method=spec, seed=i) for i in range(batch)]
    step_ms = timed_decode(engine, rids, steps)
    nbytes = weight_bytes(engine, batch) + kv_bytes(engine, rids, read_rule(method), spec)
    for r in rids:
        engine.abort(r)
    return {
        "method": method,
        "batch": batch,
        "context": ctx,
        "budget": None if spec is None else spec.budget,
        "kv_tokens_per_head": int(torch.as_tensor(kv).float().mean()),
        "tokens_per_s": batch / step_ms * 1e3,
        "step_ms": step_ms,
        "bytes_per_step": nbytes,
        "roofline_fraction": nbytes / (bw * step_ms * 1e-3),
        "kv": "synthetic",
        "graph_steps": engine.runner.graph_steps,
    }


def real_prefill_row(engine, method: str, spec: MethodSpec | None, batch: int, ctx: int, steps: int, bw: float):
    params = SamplingParams(max_tokens=steps + 8, ignore_eos=True)
    gen = torch.Generator().manual_seed(1)
    rids = [
        engine.add_request(torch.randint(0, 1000, (ctx,), generator=gen).tolist(), params, method=spec)
        for _ in range(batch)
    ]
    t0 = time.perf_counter()
    while not all(engine._seqs[r].in_decode for r in rids):
        engine.step()
    torch.cuda.synchronize()
    prefill_s = time.perf_counter() - t0
    step_ms = timed_decode(engine, rids, steps)
    nbytes = weight_bytes(engine, batch) + kv_bytes(engine, rids, read_rule(method), spec)
    kv_per_head = kv_bytes(engine, rids) / (
        batch
        * engine.shape.num_layers
        * engine.shape.num_kv_heads
        * engine.model_config.head_dim
        * 2
        * engine.pool.k.element_size()
    )
    for r in rids:
        engine.abort(r)
    return {
        "method": method,
        "batch": batch,
        "context": ctx,
        "budget": None if spec is None else spec.budget,
        "kv_tokens_per_head": round(kv_per_head),
        "tokens_per_s": batch / step_ms * 1e3,
        "step_ms": step_ms,
        "bytes_per_step": nbytes,
        "roofline_fraction": nbytes / (bw * step_ms * 1e-3),
        "kv": "real_prefill",
        "prefill_s": prefill_s,
    }


def finish(args, bw: float, dense_max: int, hf: dict, rows: list[dict], out: Path) -> dict:
    """Ratios of every row so far, written to ``out`` (after each row: a run cut short keeps them).
    ``roofline_ratio_same_batch`` is the ratio to dense at the same batch that the bytes alone allow:
    what both would show if each step ran at the copy bandwidth."""
    dense_rows = {r["batch"]: r for r in rows if r["method"] == "dense" and r["kv"] == "synthetic"}
    best_dense = max(r["tokens_per_s"] for r in dense_rows.values())
    for r in rows:
        same = dense_rows.get(r["batch"])
        r["ratio_vs_dense"] = r["tokens_per_s"] / best_dense  # vs our dense at its largest batch
        r["ratio_vs_dense_same_batch"] = r["tokens_per_s"] / same["tokens_per_s"] if same else None
        r["roofline_ratio_same_batch"] = same["bytes_per_step"] / r["bytes_per_step"] if same else None
        r["hf_step_ms"] = hf.get(r["batch"])
        r["ratio_vs_hf"] = (hf[r["batch"]] / r["step_ms"]) if r["batch"] in hf else None
    result = {
        "device": torch.cuda.get_device_name(0),
        "shape": args.shape,
        "copy_bandwidth_tb_s": bw / 1e12,
        "dense_largest_batch": dense_max,
        "hf_step_ms": hf,
        "rows": rows,
        "note": "kv=synthetic rows decode from synthetically filled KV of the size the method leaves; "
        "kv=real_prefill rows prefill a real prompt and let the method compress",
    }
    out.write_text(json.dumps(result, indent=1))
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--shape", default="llama-3.1-8b", choices=sorted(SHAPES))
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--budget", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--methods", default="snapkv,streaming_llm,adakv,quest")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--no-real-prefill", action="store_true")
    ap.add_argument("--out", default="benchmarks/results/decode_throughput.json")
    args = ap.parse_args()
    ctx, steps = args.context, args.steps
    cfg_dir = write_config(args.shape, ctx)
    bw = copy_bandwidth()
    print(f"{torch.cuda.get_device_name(0)}: copy bandwidth {bw / 1e12:.2f} TB/s")
    hf = {} if args.skip_hf else hf_decode(cfg_dir, [1, 4, 8, 16, 24], ctx, steps)

    engine = LLMEngine(
        EngineConfig(
            model=cfg_dir,
            page_size=32,
            max_model_len=ctx + 1024,
            max_num_seqs=512,
            gpu_memory_utilization=0.93,
            prefill_chunk_size=4096,
            max_num_batched_tokens=4096,
        ),
        random_weights=True,
    )
    engine.pool.k.normal_()
    engine.pool.v.normal_()
    rows = []
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    dense_max = max_batch(engine, ctx, steps)
    print(f"pool {engine.pool.num_pages} pages of {engine.pool.bytes_per_page} B; dense fits {dense_max} at {ctx}")
    for B in sorted({1, 4, 8, 32, dense_max}):
        if B > dense_max or B < 1:
            print(f"  dense batch {B}: does not fit")
            continue
        rows.append(synthetic_row(engine, "dense", None, B, ctx, ctx - 1, steps, bw))
        finish(args, bw, dense_max, hf, rows, out)
        print(
            f"  dense batch {B}: {rows[-1]['step_ms']:.2f} ms/step, {rows[-1]['tokens_per_s']:.0f} tok/s, "
            f"roofline {rows[-1]['roofline_fraction']:.2f}"
        )
    methods = [m for m in args.methods.split(",") if m]
    for m in methods:
        if m not in REGISTRY:
            print(f"  {m}: not implemented in this checkout, skipped")
            continue
        spec = METHOD_SPECS[m].spec(args.budget)
        kept = engine.controller.method_for(spec).kept_tokens(ctx - 1)  # what the method holds per head
        kv = METHOD_SPECS[m].head_lengths(engine, kept, ctx)
        B = max_batch(engine, kept, steps)
        for batch in sorted({B, 4, dense_max}, reverse=True):  # its largest; and dense's, for the same-batch ratio
            if batch < 1 or batch > B:
                print(f"  {m} batch {batch}: does not fit")
                continue
            rows.append(synthetic_row(engine, m, spec, batch, ctx, kv, steps, bw))
            finish(args, bw, dense_max, hf, rows, out)
            print(f"  {m} batch {batch}: {rows[-1]['step_ms']:.2f} ms/step, {rows[-1]['tokens_per_s']:.0f} tok/s")
    if not args.no_real_prefill:
        for m in ["dense"] + [m for m in methods if m in REGISTRY]:
            spec = None if m == "dense" else METHOD_SPECS[m].spec(args.budget)
            rows.append(real_prefill_row(engine, m, spec, 1, ctx, steps, bw))
            finish(args, bw, dense_max, hf, rows, out)
            print(
                f"  {m} real prefill: {rows[-1]['prefill_s']:.1f} s prefill, {rows[-1]['step_ms']:.2f} ms/step, "
                f"kv/head {rows[-1]['kv_tokens_per_head']}"
            )

    result = finish(args, bw, dense_max, hf, rows, out)
    print(
        f"\n{'method':<14}{'batch':>6}{'kv':>13}{'tok/s':>10}{'ms':>8}{'roof':>6}{'x dense':>9}{'x same B':>9}{'x hf':>7}"
    )
    for r in rows:
        hfr = f"{r['ratio_vs_hf']:.1f}" if r["ratio_vs_hf"] else "-"
        same = f"{r['ratio_vs_dense_same_batch']:.2f}" if r["ratio_vs_dense_same_batch"] else "-"
        print(
            f"{r['method']:<14}{r['batch']:>6}{r['kv']:>13}{r['tokens_per_s']:>10.0f}{r['step_ms']:>8.2f}"
            f"{r['roofline_fraction']:>6.2f}{r['ratio_vs_dense']:>9.2f}{same:>9}{hfr:>7}"
        )
    try:
        plot(result, out.with_suffix(".png"))
    except ImportError:
        print("matplotlib missing: no plot")


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in result["rows"] if r["kv"] == "synthetic"]
    labels = [f"{r['method']}\nB={r['batch']}" for r in rows]
    fig, ax = plt.subplots(figsize=(max(8, len(rows) * 0.9), 4.5))
    ax.bar(
        range(len(rows)),
        [r["tokens_per_s"] for r in rows],
        color=["#888" if r["method"] == "dense" else "#2a7" for r in rows],
    )
    for i, r in enumerate(rows):
        ax.text(i, r["tokens_per_s"], f"{r['roofline_fraction']:.2f}", ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(rows)), labels, fontsize=7)
    ax.set_ylabel("decode tokens/s")
    ax.set_yscale("log")
    ax.set_title(f"{result['shape']} on {result['device']}, {rows[0]['context']} context (labels: roofline fraction)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
