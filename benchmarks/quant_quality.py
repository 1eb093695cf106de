"""KV quantization on SmolLM2: agreement with dense over greedy tokens, KL, and bytes per cached token.

For each prompt the dense engine generates N greedy tokens; each quantized engine (kivi 2/4-bit,
fp8) then decodes the same tokens (teacher forcing: every step's sampled token is replaced by the
dense one), so position i compares the two engines on the same context. Reported per method:
top-1 agreement, mean / max KL(dense || quantized), the free-running prefix (tokens generated
identically before the first disagreement) and the bytes per cached token of the session as the
pool accounts them, against a bf16 plain page. kivi runs with KIVI's residual window (the last
R = 128 tokens of every head in full precision) and without it (R = 0); the story prompt's
121-token context fits in the window, so its R = 128 rows read no quantized token.

    python benchmarks/quant_quality.py [--device cpu|cuda] [--tokens 64] [--out benchmarks/results/quant_quality.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from engine.cache.pages import PagePool
from engine.config import EngineConfig
from engine.llm import LLMEngine
from engine.sampling import SamplingParams

ROOT = Path(__file__).resolve().parents[1]
DESIGN = (ROOT / "README.md").read_text()[:2400]
PROMPTS = {
    "design_qa": [
        {"role": "system", "content": "You are a helpful assistant. Project notes:\n" + DESIGN},
        {"role": "user", "content": "Explain in a few sentences what this project does and how to run it."},
    ],
    "story": [
        {
            "role": "user",
            "content": "Write a short story about a lighthouse keeper who finds a message in a "
            "bottle. Give it a beginning, a middle and an end.",
        }
    ],
}
# kivi with the paper's residual window (R = 128) and without (R = 0: only the open page exact)
METHODS = [
    ("kivi", {"bits": 2, "residual_length": 0}),
    ("kivi", {"bits": 2, "residual_length": 128}),
    ("kivi", {"bits": 4, "residual_length": 0}),
    ("kivi", {"bits": 4, "residual_length": 128}),
    ("fp8", {}),
]


def forced_decode(engine: LLMEngine, ids: list[int], tokens: list[int]) -> torch.Tensor:
    """Decode ``tokens`` after the prompt ``ids`` one step at a time (teacher forcing: after each step the
    sampled token is replaced by the reference's), returning each step's logits ``[len(tokens), V]`` in
    float32. The quantized cache is read by decode attention exactly as in free-running generation;
    position i is the free-running token whenever positions before it agreed. Also used by
    tests/test_quant_methods.py and tests/test_quant_gpu.py."""
    return forced_decode_batch(engine, [(ids, tokens)])[0]


def forced_decode_batch(engine: LLMEngine, pairs: list[tuple[list[int], list[int]]], method=None) -> list[torch.Tensor]:
    """``forced_decode`` for several (prompt, tokens) pairs decoded together in one batch, each with
    ``method`` (a MethodSpec; None: the engine's default). benchmarks/quality.py measures decode-time
    methods (quest, h2o, rkv, ...) with it."""
    rids = [
        engine.add_request(
            ids, SamplingParams(max_tokens=len(tokens), ignore_eos=True, return_logits=True), method=method
        )
        for ids, tokens in pairs
    ]
    seqs = [engine._seqs[r] for r in rids]
    done = [0] * len(pairs)
    while any(d < len(t) for d, (_, t) in zip(done, pairs)):
        engine.step()
        for i, (seq, (_, tokens)) in enumerate(zip(seqs, pairs)):
            if len(seq.output_ids) > done[i]:  # one new token per step: replace it by the reference's
                seq.token_ids[-1] = tokens[done[i]]
                done[i] += 1
    return [torch.stack(seq.step_logits).float() for seq in seqs]


def agreement(ref_logits: torch.Tensor, logits: torch.Tensor, tokens: list[int]) -> tuple[float, torch.Tensor, int]:
    """Compare teacher-forced ``logits`` with the reference's (``ref_logits``, which generated ``tokens``
    greedily): top-1 agreement with ``tokens``, per-step KL(reference || logits), and the free-running
    prefix (how many tokens a free-running generation reproduces before the first disagreement)."""
    ref, logits, want = ref_logits.float().cpu(), logits.float().cpu(), torch.tensor(tokens)
    top1 = logits.argmax(-1)
    lp, lq = torch.log_softmax(ref, -1), torch.log_softmax(logits, -1)
    kl = (lp.exp() * (lp - lq)).sum(-1)
    miss = (top1 != want).nonzero().flatten().tolist()
    return float((top1 == want).float().mean()), kl, miss[0] if miss else len(tokens)


def session_bytes(engine: LLMEngine, ids: list[int], n: int) -> tuple[float, int]:
    engine.add_turn("bytes", ids, SamplingParams(max_tokens=n, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    tokens = int(engine.manager.seq_lengths("bytes").sum())
    per = engine.manager.kv_bytes("bytes") / tokens
    engine.end_session("bytes")
    return per, tokens // (engine.shape.num_layers * engine.shape.num_kv_heads)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument(
        "--prefill-chunk-size",
        type=int,
        default=2048,
        help="the default prefills each prompt in one chunk, in full precision, as KIVI does",
    )
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "quant_quality.json"))
    a = ap.parse_args()
    base = dict(
        device=a.device,
        num_pages=8000,
        max_num_seqs=4,
        max_cached_seqs=8,
        prefill_chunk_size=a.prefill_chunk_size,
        max_num_batched_tokens=max(1024, a.prefill_chunk_size),
        cuda_graphs=False,
    )
    dense = LLMEngine(EngineConfig(**base))
    refs = {}
    for name, msgs in PROMPTS.items():
        ids = dense.apply_chat_template(msgs)
        out = dense.generate([ids], SamplingParams(max_tokens=a.tokens, ignore_eos=True, return_logits=True))[0]
        refs[name] = (ids, out.token_ids, out.step_logits.float())
    bf16 = PagePool(1, dense.pool.page_size, dense.model_config.head_dim, torch.bfloat16, "cpu").bytes_per_token
    dense_bytes, _ = session_bytes(dense, refs["design_qa"][0], a.tokens)
    rows = [
        {
            "method": "dense",
            "prompt": "design_qa",
            "agreement": 1.0,
            "kl_mean": 0.0,
            "kl_max": 0.0,
            "free_running_prefix": a.tokens,
            "bytes_per_token": dense_bytes,
            "x_bf16": dense_bytes / bf16,
        }
    ]
    for method, args in METHODS:
        t0 = time.time()
        eng = LLMEngine(EngineConfig(**base, method=method, method_args=args))
        label = method + "".join(f" {k}={v}" for k, v in args.items())
        per, ctx = session_bytes(eng, refs["design_qa"][0], a.tokens)
        for name, (ids, tokens, ref_logits) in refs.items():
            agree, kl, prefix = agreement(ref_logits, forced_decode(eng, ids, tokens), tokens)
            rows.append(
                {
                    "method": label,
                    "prompt": name,
                    "prompt_tokens": len(ids),
                    "agreement": agree,
                    "kl_mean": float(kl.mean()),
                    "kl_max": float(kl.max()),
                    "free_running_prefix": prefix,
                    "bytes_per_token": per,
                    "x_bf16": per / bf16,
                    "context_per_head": ctx,
                }
            )
            print(json.dumps(rows[-1]), f"({time.time() - t0:.1f}s)", flush=True)
        del eng
    result = {
        "device": str(dense.device),
        "dtype": str(dense.dtype),
        "model": "SmolLM2-135M-Instruct",
        "command": "python benchmarks/quant_quality.py " + " ".join(sys.argv[1:]),
        "tokens": a.tokens,
        "page_size": dense.pool.page_size,
        "prefill_chunk_size": a.prefill_chunk_size,
        "bf16_bytes_per_token": bf16,
        "rows": rows,
    }
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=1))
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
