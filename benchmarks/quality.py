"""Quality of sparse methods next to dense, on any methods of the registry.

Two measurements, each method at each budget (a fraction of the context, ``budget_ratio``;
methods without a budget run once):

(a) passkey retrieval: a pass key (5 digits) hidden at a random depth of a locally generated
    haystack of ``--context`` tokens (the classic repeated filler); the model is asked for it and
    answers greedily. Accuracy = answers containing the key.
(b) agreement with dense on real text, teacher-forced, two ways (``--agreement-modes``):
    ``prefill``: a session's first turn is ``--kl-context`` tokens of a text (the method compresses
    them), the second turn feeds the next ``--continuation`` tokens through the compressed cache
    as one prefill (the Chain Cache's path); ``decode``: the context is a request's prompt and the
    continuation goes through decode steps, one token at a time, each sampled token replaced by
    the text's (what decode-time methods - quest, omnikv, offload, h2o, rkv - act on; a prefill
    never runs their selection). Per position, top-1 agreement of the next-token prediction with
    dense and KL(dense || method), averaged over ``--segments`` segments.

Samples of one configuration run through the engine together (continuous batching). Results are
saved after every configuration, so a cut-short run keeps what it measured.

    python benchmarks/quality.py --methods dense,h2o,tova,snapkv --out benchmarks/results/quality_eviction.json
    python benchmarks/quality.py --methods dense,quest --budgets 0.25 --samples 5   # issue 4 reuses it
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from engine.config import EngineConfig  # noqa: E402
from engine.method_spec import MethodSpec  # noqa: E402
from engine.llm import LLMEngine  # noqa: E402
from engine.methods import REGISTRY, get_method_class  # noqa: E402
from engine.sampling import SamplingParams  # noqa: E402

from benchmarks.quant_quality import forced_decode_batch  # noqa: E402

FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
TEXTS = [
    Path("/usr/share/common-licenses/GPL-3"),
    Path(sys.base_prefix) / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "LICENSE.txt",
    ROOT / "README.md",
]


def passkey_prompts(engine: LLMEngine, n: int, context: int, seed: int) -> list[tuple[list[int], str]]:
    """``n`` (prompt tokens, key) pairs: a haystack of about ``context`` tokens with the key at a
    random depth, wrapped in the chat template."""
    rng = random.Random(seed)
    per = len(engine.encode(FILLER))
    out = []
    for _ in range(n):
        key = str(rng.randint(10000, 99999))
        reps = max(1, (context - 80) // per)
        depth = rng.randint(0, reps)
        needle = f"The pass key is {key}. Remember it. {key} is the pass key. "
        text = (
            "There is a pass key hidden inside a lot of irrelevant text. Find it and memorize it.\n"
            + FILLER * depth
            + needle
            + FILLER * (reps - depth)
            + "\nWhat is the pass key?"
        )
        out.append((engine.apply_chat_template([{"role": "user", "content": text}]), key))
    return out


def configs(methods: list[str], budgets: list[float], method_args: dict) -> list[tuple[str, float | None, MethodSpec]]:
    out = []
    for name in methods:
        cls = get_method_class(name)
        args = dict(method_args.get(name, {}))
        if cls.needs_budget:
            out.extend((name, b, MethodSpec(name, budget_ratio=b, method_args=args)) for b in budgets)
        else:
            out.append((name, None, MethodSpec(name, method_args=args)))
    return out


def run_requests(
    engine: LLMEngine, prompts: list[list[int]], params: SamplingParams, spec: MethodSpec
) -> list[list[int]]:
    ids = [engine.add_request(p, params, method=spec) for p in prompts]
    done: dict = {}
    while len(done) < len(ids):
        for o in engine.step():
            if o.finished:
                done[o.request_id] = list(o.token_ids)
    return [done[i] for i in ids]


def passkey(engine: LLMEngine, spec: MethodSpec, prompts) -> dict:
    evicted = engine.controller.evicted_tokens
    outs = run_requests(engine, [p for p, _ in prompts], SamplingParams(max_tokens=12), spec)
    hits = [key in engine.tokenizer.decode(o) for o, (_, key) in zip(outs, prompts)]
    L, H = engine.shape.num_layers, engine.shape.num_kv_heads
    total = sum(len(p) for p, _ in prompts) * L * H
    return {
        "accuracy": sum(hits) / len(hits),
        "correct": sum(hits),
        "samples": len(hits),
        "evicted_fraction": (engine.controller.evicted_tokens - evicted) / total,
    }


def continuation_logits(
    engine: LLMEngine, spec: MethodSpec, segments: list[tuple[list[int], list[int]]]
) -> list[torch.Tensor]:
    """Teacher-forced logits of each segment's continuation, after its context went in as a turn."""
    sids = [f"q{time.monotonic_ns()}-{i}" for i in range(len(segments))]
    for sid, (ctx, _) in zip(sids, segments):
        engine.add_turn(sid, ctx, SamplingParams(max_tokens=1), method=spec)
    _drain(engine, set(sids))
    seqs = {}
    for sid, (_, cont) in zip(sids, segments):
        engine.add_turn(sid, cont, SamplingParams(max_tokens=1, prompt_logits=True), method=spec)
        seqs[sid] = engine._seqs[sid]
    _drain(engine, set(sids))
    out = []
    for sid, (_, cont) in zip(sids, segments):
        logits = torch.cat(seqs[sid].prompt_logits)
        out.append(logits[-len(cont) :].float())
        engine.end_session(sid)
    return out


def _drain(engine: LLMEngine, ids: set) -> None:
    left = set(ids)
    while left:
        for o in engine.step():
            if o.finished:
                left.discard(o.request_id)


def agreement(dense: list[torch.Tensor], other: list[torch.Tensor]) -> dict:
    top1, kl, n = 0, 0.0, 0
    for d, o in zip(dense, other):
        top1 += int((d.argmax(-1) == o.argmax(-1)).sum())
        lp, lq = torch.log_softmax(d, -1), torch.log_softmax(o, -1)
        kl += float((lp.exp() * (lp - lq)).sum())
        n += d.shape[0]
    return {"top1_agreement": top1 / n, "mean_kl": kl / n, "positions": n}


def text_segments(
    engine: LLMEngine, path: Path, n: int, context: int, continuation: int
) -> list[tuple[list[int], list[int]]]:
    tokens = engine.encode(path.read_text(errors="replace"))
    span = context + continuation
    if len(tokens) < span:
        raise SystemExit(f"{path} has {len(tokens)} tokens; a segment needs {span}")
    starts = [int(i * (len(tokens) - span) / max(n - 1, 1)) for i in range(n)]
    return [(tokens[s : s + context], tokens[s + context : s + span]) for s in starts]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--methods", default=",".join(sorted(REGISTRY)), help="comma-separated registry names (dense is always run)"
    )
    ap.add_argument("--budgets", default="0.5,0.25", help="budget ratios (fraction of the context kept per head)")
    ap.add_argument("--method-args", default="{}", help='JSON: {"method": {"param": value}}')
    ap.add_argument("--samples", type=int, default=20, help="passkey haystacks")
    ap.add_argument("--context", type=int, default=2048, help="passkey haystack tokens")
    ap.add_argument("--segments", type=int, default=4, help="real-text segments for (b)")
    ap.add_argument("--kl-context", type=int, default=1024)
    ap.add_argument("--continuation", type=int, default=256)
    ap.add_argument("--text", default=None, help="real text for (b) (default: the GPL-3 text, else Python's LICENSE)")
    ap.add_argument("--agreement-modes", default="prefill,decode", help="prefill and/or decode (see (b) above)")
    ap.add_argument("--skip", default="", help="passkey and/or agreement, to skip a part")
    ap.add_argument("--model", default="smollm2")
    # engine settings that split a device-specific difference (same names as EngineConfig's fields)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--cuda-graphs", default="true", help="decode under CUDA graphs (GPU)")
    ap.add_argument("--async-decode", default="true", help="launch decode steps one ahead (GPU)")
    ap.add_argument("--batch", type=int, default=8, help="samples run through the engine together")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "quality.json"))
    args = ap.parse_args(argv)

    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    methods = ["dense"] + [m for m in methods if m != "dense"]  # dense first: the reference
    budgets = [float(b) for b in args.budgets.split(",") if b.strip()]
    cfgs = configs(methods, budgets, json.loads(args.method_args))
    longest = max(args.context + 200, args.kl_context + args.continuation + 8)
    # twice the longest input: kvzip's scoring pass appends a repeat of the context to the cache
    engine = LLMEngine(
        EngineConfig(
            model=args.model,
            max_model_len=2 * longest + 64,
            prefill_chunk_size=longest,
            max_num_batched_tokens=longest * 2,
            max_num_seqs=args.batch,
            kv_cache_gb=4.0,
            dtype=args.dtype,
            cuda_graphs=args.cuda_graphs,
            async_decode=args.async_decode,
        )
    )
    skip = set(args.skip.split(","))
    result = {
        "description": "benchmarks/quality.py: passkey retrieval (a) and teacher-forced agreement with dense (b), "
        "each method at each budget ratio next to dense.",
        "command": "python " + " ".join([Path(sys.argv[0]).as_posix()] + (argv if argv is not None else sys.argv[1:])),
        "model": args.model,
        "device": str(engine.device),
        "host": platform.processor() or platform.machine(),
        "torch_threads": torch.get_num_threads(),
        "passkey": None,
        "agreement": None,
    }
    out_path = Path(args.out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.time()

    def save():
        result["elapsed_s"] = round(time.time() - t0, 1)
        out_path.write_text(json.dumps(result, indent=1) + "\n")

    if "passkey" not in skip:
        prompts = passkey_prompts(engine, args.samples, args.context, args.seed)
        result["passkey"] = {
            "context_tokens": round(sum(len(p) for p, _ in prompts) / len(prompts)),
            "samples": len(prompts),
            "rows": [],
        }
        for name, budget, spec in tqdm(cfgs, desc="passkey", unit="config"):
            row = {
                "method": name,
                "budget_ratio": budget,
                "accuracy": 0.0,
                "correct": 0,
                "samples": 0,
                "evicted_fraction": 0.0,
            }
            for i in range(0, len(prompts), args.batch):
                r = passkey(engine, spec, prompts[i : i + args.batch])
                row["correct"] += r["correct"]
                row["evicted_fraction"] += r["evicted_fraction"] * r["samples"]
                row["samples"] += r["samples"]
            row["evicted_fraction"] = round(row["evicted_fraction"] / row["samples"], 4)
            row["accuracy"] = row["correct"] / row["samples"]
            result["passkey"]["rows"].append(row)
            save()

    if "agreement" not in skip:
        path = Path(args.text) if args.text else next(p for p in TEXTS if p.exists())
        segments = text_segments(engine, path, args.segments, args.kl_context, args.continuation)
        result["agreement"] = {
            "text": path.name,
            "context_tokens": args.kl_context,
            "continuation_tokens": args.continuation,
            "segments": len(segments),
            "rows": [],
        }
        modes = [m.strip() for m in args.agreement_modes.split(",") if m.strip()]
        if not set(modes) <= {"prefill", "decode"}:
            raise SystemExit(f"--agreement-modes takes prefill and/or decode, not {args.agreement_modes!r}")
        result["agreement"]["modes"] = modes
        dense = {}
        for name, budget, spec in tqdm(cfgs, desc="agreement", unit="config"):
            row = {"method": name, "budget_ratio": budget}
            for mode in modes:
                if mode == "prefill":
                    logits = continuation_logits(engine, spec, segments)
                else:
                    logits = forced_decode_batch(engine, segments, spec)
                dense.setdefault(mode, logits)
                r = agreement(dense[mode], logits)
                row.update(r if mode == "prefill" else {f"decode_{k}": v for k, v in r.items()})
            result["agreement"]["rows"].append(row)
            save()
    save()
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
