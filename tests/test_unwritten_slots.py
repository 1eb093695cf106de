"""Attention and every method read only what the cache holds.

A page's slots past its head's length, the pages a shorter head's table does not name (read as page
0 after the ``-1`` entries are clamped), freed pages and never-written pages may hold anything:
stale K/V of an earlier owner, or NaN (on the GPU a CUDA graph's padding rows write into a scratch
page; issue 3 was a NaN from there read through a shorter head's clamped table entries). Here
every floating slot of the pool starts as NaN; a two-turn session of every method must give
bit-for-bit the same tokens and logits as on a pool that starts zeroed.
"""

from __future__ import annotations

import json

import pytest
import torch

from engine.method_spec import MethodSpec
from engine.llm import LLMEngine
from engine.methods import REGISTRY
from engine.sampling import SamplingParams

from tests.conftest import make_engine


def spec_for(name: str, tmp_path) -> MethodSpec:
    cls = REGISTRY[name]
    if name == "duo_attention":  # the tiny model has no shipped head pattern: half its heads streaming
        path = tmp_path / "duo.json"
        path.write_text(
            json.dumps(
                {"num_layers": 3, "num_kv_heads": 2, "head_dim": 16, "scores": [[0.1, 0.9], [0.8, 0.2], [0.3, 0.7]]}
            )
        )
        return MethodSpec(name, method_args={"pattern": str(path), "n_sink": 4, "n_recent": 24})
    if name == "kivi":  # value groups must divide head_dim 16; a short window so most pages are sealed
        return MethodSpec(name, method_args={"value_group": 8, "residual_length": 8})
    return MethodSpec(name, budget=40) if getattr(cls, "needs_budget", False) else MethodSpec(name)


def poison(engine: LLMEngine) -> None:
    fmt = engine.pool.format
    for t in fmt._tensors():
        if t.is_floating_point():
            t.fill_(float("nan"))


def session(engine: LLMEngine, spec: MethodSpec) -> tuple[list[int], torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(4)
    first = torch.randint(0, 320, (150,), generator=gen).tolist()
    second = torch.randint(0, 320, (37,), generator=gen).tolist()
    tokens, logits = [], []
    for prompt in (first, second):
        engine.add_turn(
            "s",
            prompt,
            SamplingParams(max_tokens=10, ignore_eos=True, prompt_logits=True, return_logits=True),
            method=spec,
        )
        seq = engine._seqs["s"]
        while engine.has_unfinished():
            engine.step()
        tokens += seq.output_ids[-10:]
        logits += [torch.cat(seq.prompt_logits), torch.stack(seq.step_logits)]
    engine.end_session("s")
    return tokens, torch.cat(logits), engine.pool.num_free


@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_nan_in_unwritten_slots_changes_nothing(name, tiny_models, tmp_path):
    path, _ = tiny_models("llama")  # 3 layers, 2 kv-heads of head_dim 16
    spec = spec_for(name, tmp_path)
    runs = []
    for poisoned in (False, True):
        engine = make_engine(
            path,
            method=name,
            method_args=dict(spec.method_args),
            budget=spec.budget,
            num_pages=600,
            page_size=4,
            prefill_chunk_size=64,
            max_num_batched_tokens=256,
        )
        if poisoned:
            poison(engine)
        runs.append(session(engine, spec))
    (tok_a, log_a, free_a), (tok_b, log_b, free_b) = runs
    assert bool(torch.isfinite(log_b).all()), f"{name}: a NaN in an unwritten slot reached the logits"
    assert tok_a == tok_b and torch.equal(log_a, log_b) and free_a == free_b
