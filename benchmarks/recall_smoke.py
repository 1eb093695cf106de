"""A quick end-to-end check of ``<method>+recall`` on one device (tiny random Llama): several sessions
of four turns with recall at turns and during decoding, then a snapshot resumed on a fresh engine.
Prints the recall tier's counters; raises on any error. ``python benchmarks/recall_smoke.py --device cuda``"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from engine.method_spec import MethodSpec  # noqa: E402
from engine.llm import LLMEngine  # noqa: E402
from engine.sampling import SamplingParams  # noqa: E402
from tests.conftest import make_engine, make_tiny, run_turn  # noqa: E402


def run(engine: LLMEngine, sid: str, tokens: list[int], params, method=None) -> list[int]:
    out = run_turn(engine, sid, tokens, params, method=method)
    if out.finish_reason == "failed":
        raise RuntimeError(f"turn of {sid} failed: {out}")
    return out.token_ids


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--methods", default="snapkv+recall,streaming_llm+recall,kvzip+recall")
    args = ap.parse_args()
    path = tempfile.mkdtemp()
    make_tiny("llama", path)  # the tests' tiny Llama and engine factory (tests/conftest.py)
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    cfg = dict(device=args.device, num_pages=4000, page_size=4, prefill_chunk_size=64)
    engine = make_engine(path, cfg)
    g = torch.Generator().manual_seed(0)
    turns = [torch.randint(3, 300, (n,), generator=g).tolist() for n in (90, 40, 40, 40)]
    for m in args.methods.split(","):
        spec = MethodSpec(m, budget=24, method_args={"recall_interval": 3, "cold_format": "fp8"})
        outs = [run(engine, m, t, params, spec if i == 0 else None) for i, t in enumerate(turns[:3])]
        snap = engine.snapshot_session(m)
        other = make_engine(path, cfg)
        other.load_session(snap)
        same = run(other, m, turns[3], params) == run(engine, m, turns[3], params)
        tier = engine.controller.recall
        print(f"{m}: {outs[-1]} resumed-same={same} recalls={tier.recalls} recalled={tier.recalled_tokens}")
        assert same, m
    print("recall smoke ok on", args.device)


if __name__ == "__main__":
    main()
