"""Which tokens of the record a question asks about does a method keep? (issue 20's diagnosis)

The agent-quality harness (benchmarks/agent_quality.py) shows score-based methods losing answers that
streaming_llm and dense keep. This script looks inside: it runs the same chain sessions (one per
sample, in process, benchmarks/agent_sessions.py) and, at each question, reads the session's cache
(``CacheManager.positions``: the original position of every token each (layer, kv-head) still holds,
after the turn's reply) and reports, for each token of the record asked about (``key``, ``:``, the
space, the value's digits one by one), the fraction of (layer, kv-head) that kept it, with the answer.

    python benchmarks/agent_quality_kept.py --family shared --size N5-r8 --samples 8 \\
        --methods streaming_llm,snapkv,tova,keydiff,expected_attention --budget 0.5

What it showed (SmolLM2-135M, CPU): the value's digits are tokens of their own, and a question's
attention at the end of its prompt lands on the key, the colon and the first digit; the later digits
are attended only while the answer is decoded, after the compression. snapkv and tova keep the
first digit in most heads and the last ones in few, and answer with the right first digits and
wrong last ones; streaming_llm keeps a record whole or not at all.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.agent_sessions import _drain, _params, encode_sample  # noqa: E402
from benchmarks.agent_tasks import FAMILIES, SIZES, Size, is_correct, make_samples  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.method_spec import MethodSpec  # noqa: E402
from engine.llm import LLMEngine  # noqa: E402


def size_of(family: str, label: str) -> Size:
    for sizes in SIZES.values():
        for s in sizes.get(family, []):
            if s.label == label:
                return s
    raise SystemExit(f"no size {label!r} of {family!r} in benchmarks/agent_tasks.py SIZES")


def record_span(engine: LLMEngine, history: list[int], key: str, value: str) -> tuple[list[int], list[str]]:
    """Positions and texts of the tokens of the last ``key: value`` line before the question (the
    record asked about; for ``state`` its latest update)."""
    pieces = [engine.tokenizer.decode([t]) for t in history]
    offsets, n = [], 0
    for p in pieces:
        offsets.append(n)
        n += len(p)
    text = "".join(pieces)
    at = text.rfind(f"\n{key}: {value}")
    if at < 0:
        at = text.find(f"{key}: {value}")  # the file's first line follows the tool header directly
    else:
        at += 1
    end = at + len(key) + 2 + len(value)
    span = [i for i, o in enumerate(offsets) if at <= o < end]
    return span, [pieces[i] for i in span]


def run(engine: LLMEngine, family: str, size: Size, samples: int, seed: int, method: str, budget: float) -> dict:
    per_token: list[list[float]] = []
    answers = []
    for sample in make_samples(family, size, samples, seed):
        enc = encode_sample(engine, sample)
        final = sum(len(t.tokens) for t in enc) + sum(t.question is not None for t in enc) * 5
        spec = MethodSpec("dense") if method == "dense" else MethodSpec(method, budget=math.ceil(budget * final))
        sid, history = f"kept-{method}-{sample.seed}", []
        for t, turn in enumerate(enc):
            engine.add_turn(sid, turn.tokens, _params(turn), spans=turn.spans, method=spec if t == 0 else None)
            out = _drain(engine, {sid})[sid]
            history += turn.tokens + list(out.token_ids)
            if turn.question is None:
                continue
            key = sample.turns[t].pieces[-1].text.rsplit("\n", 1)[-1].rstrip(":")
            span, texts = record_span(engine, history, key, turn.question)
            pos = engine.manager.positions(sid)  # [L, H, T], -1 past a head's end
            kept = torch.stack([(pos == p).any(-1).float().mean() for p in span]).tolist()
            per_token.append(kept)
            answer = engine.tokenizer.decode(out.token_ids, skip_special_tokens=True)
            answers.append({"expected": turn.question, "answer": answer, "correct": is_correct(answer, turn.question)})
            answers[-1]["tokens"] = texts
        engine.end_session(sid)
    # the record's tokens from its end: the value's last digit is -1 (keys differ in length)
    width = max(len(k) for k in per_token)
    from_end = [[k[-i] for k in per_token if len(k) >= i] for i in range(width, 0, -1)]
    return {
        "method": method,
        "budget": budget,
        "questions": len(answers),
        "correct": sum(a["correct"] for a in answers),
        "kept_from_end": {str(-i): sum(v) / len(v) for i, v in zip(range(width, 0, -1), from_end) if v},
        "answers": answers,
    }


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--family", default="shared", choices=FAMILIES)
    ap.add_argument("--size", default="N5-r8", help="a size label of benchmarks/agent_tasks.py SIZES")
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--methods", default="streaming_llm,snapkv,tova,keydiff,expected_attention")
    ap.add_argument("--budget", type=float, default=0.5, help="fraction of the sample's final context")
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--out", default=None, help="save the JSON here")
    args = ap.parse_args(argv)
    engine = LLMEngine(
        EngineConfig(model=args.model, device=args.device, max_model_len=4096, prefix_sharing=False, kv_cache_gb=1.0)
    )
    size = size_of(args.family, args.size)
    result = {"family": args.family, "size": args.size, "samples": args.samples, "seed": args.seed, "rows": []}
    for m in ["dense"] + [x.strip() for x in args.methods.split(",") if x.strip()]:
        row = run(engine, args.family, size, args.samples, args.seed, m, args.budget)
        result["rows"].append(row)
        kept = " ".join(f"{k}:{v:.2f}" for k, v in row["kept_from_end"].items())
        print(f"{m:<20} {row['correct']}/{row['questions']} correct; kept per record token (from the end) {kept}")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
