"""Tensor parallelism on the CPU: 2 gloo ranks (spawned processes) against a 1-device engine.

One launch of a 2-rank engine runs every scenario on rank 0's replicated front door and writes its
results; the same scenarios then run on an ordinary engine here. Tiny random fp32 Llama (4 query
heads, 2 kv-heads: one kv-head per rank).
"""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from engine.cache.snapshot import SessionSnapshot, SnapshotError
from engine.config import ConfigError, EngineConfig
from engine.tensor_parallel.launcher import launch
from engine.distributed.sharding import ShardingError, ShardLayout
from engine.method_spec import MethodSpec
from engine.llm import LLMEngine, RequestError
from engine.model.loader import load_hf_config, parse_hf_config
from engine.sampling import SamplingParams

from tests.conftest import make_engine

METHODS = [
    MethodSpec("dense"),
    MethodSpec("snapkv", budget=32),
    MethodSpec("tova", budget=32),
    MethodSpec("adakv", budget=32),
    MethodSpec("quest", budget=32),
]
GREEDY = SamplingParams(max_tokens=8, ignore_eos=True)


TP_ENGINE = dict(
    device="cpu",
    dtype="float32",
    num_pages=3000,
    max_num_seqs=8,
    prefill_chunk_size=64,
    max_num_batched_tokens=256,
    max_model_len=512,
)
"""The engine settings of both sides (each adds its tensor_parallel_size)."""


def _config(path: str, tp: int) -> EngineConfig:
    """The config a 2-rank launch is given."""
    return EngineConfig(model=path, tensor_parallel_size=tp, **TP_ENGINE)


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(3, 320, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _turn(engine, sid, tokens, params, **kw):
    engine.add_turn(sid, tokens, params, **kw)
    while True:
        for out in engine.step():
            if out.request_id == sid and out.finished:
                return out


def scenarios(engine, out_path: str | None = None) -> dict:
    """Everything compared between TP=2 and TP=1 (run on rank 0's front door, or a plain engine)."""
    res: dict = {}
    out = engine.generate(
        _prompt(40, 1), SamplingParams(max_tokens=4, ignore_eos=True, prompt_logits=True, return_logits=True)
    )[0]
    res["prompt_logits"], res["step_logits"] = out.prompt_logits, out.step_logits
    try:  # refused on every rank alike: rank 0 reports it, the followers carry on
        engine.add_request([5, 10**6], GREEDY)
    except RequestError as e:
        res["bad_request"] = str(e)
    prompts = [_prompt(100, 2), _prompt(80, 3)]
    for spec in METHODS:  # two requests batched together, so decode steps mix sequences
        res[f"tokens.{spec.method}"] = [o.token_ids for o in engine.generate(prompts, GREEDY, method=spec)]
    for spec in (MethodSpec("dense"), MethodSpec("snapkv", budget=32), MethodSpec("h2o", budget=32)):
        sid = f"s-{spec.method}"
        _turn(engine, sid, _prompt(80, 4), GREEDY, method=spec)
        res[f"snapshot.{spec.method}"] = engine.snapshot_session(sid).to_bytes()
        res[f"continue.{spec.method}"] = list(_turn(engine, sid, _prompt(12, 5), GREEDY).token_ids)
    if out_path is not None:
        torch.save(res, out_path)
    return res


@pytest.fixture(scope="module")
def tiny(tiny_models):
    return tiny_models("llama")[0]


@pytest.fixture(scope="module")
def tp2(tiny, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("tp2") / "results.pt")
    assert launch(_config(tiny, 2), scenarios, out) == 0
    return torch.load(out)


@pytest.fixture(scope="module")
def tp1(tiny):
    return scenarios(make_engine(tiny, TP_ENGINE, tensor_parallel_size=1))


slow_tp = pytest.mark.slow  # spawns 2 processes (imports dominate: ~10-40 s on a loaded CPU)


@slow_tp
def test_logits_equal(tp1, tp2):
    assert "token ids" in tp2["bad_request"]
    torch.testing.assert_close(tp2["prompt_logits"], tp1["prompt_logits"], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(tp2["step_logits"], tp1["step_logits"], atol=1e-4, rtol=1e-4)


@slow_tp
@pytest.mark.parametrize("method", [m.method for m in METHODS])
def test_greedy_tokens_equal(tp1, tp2, method):
    assert tp2[f"tokens.{method}"] == tp1[f"tokens.{method}"]


@slow_tp
@pytest.mark.parametrize("method", ["dense", "snapkv"])
def test_tp2_snapshot_resumes_on_tp1(tiny, tp1, tp2, method):
    snap = SessionSnapshot.from_bytes(tp2[f"snapshot.{method}"])
    assert snap.meta["tensor_parallel"] == {"size": 2, "kv_heads_per_rank": 1}
    assert tuple(snap.kv.lengths.shape) == (3, 2)  # the whole model's kv-heads
    engine = make_engine(tiny, TP_ENGINE, tensor_parallel_size=1)
    engine.load_session(snap)
    if method == "snapkv":  # the KV moved is the compressed one
        assert int(snap.kv.lengths.max()) < 80
    out = _turn(engine, f"s-{method}", _prompt(12, 5), GREEDY)
    assert out.source_tier == "store"  # the snapshot's KV was used, not recomputed from the history
    assert list(out.token_ids) == tp2[f"continue.{method}"] == tp1[f"continue.{method}"]


@slow_tp
def test_per_rank_state_refused_on_other_tp(tiny, tp2):
    snap = SessionSnapshot.from_bytes(tp2["snapshot.h2o"])
    engine = make_engine(tiny, TP_ENGINE, tensor_parallel_size=1)
    with pytest.raises(SnapshotError, match="tensor_parallel_size 2"):
        engine.load_session(snap)


def test_layout_and_config_errors(tiny):
    mc = parse_hf_config(load_hf_config(tiny))
    with pytest.raises(ShardingError, match="kv-heads"):
        ShardLayout.of(mc, 4, 0)
    layout = ShardLayout.of(mc, 2, 1)
    assert (layout.num_heads, layout.num_kv_heads, list(layout.kv_heads)) == (2, 1, [1])
    with pytest.raises(ConfigError, match="tensor_parallel_size"):
        EngineConfig(tensor_parallel_size=0)
    with pytest.raises(RuntimeError, match="launcher"):
        LLMEngine(_config(tiny, 2))  # not in a process group


def kill_a_follower_then_step(engine) -> None:
    """Rank 0: SIGKILL the other rank (a sibling under the launcher), then keep stepping."""
    launcher = os.getppid()
    with open(f"/proc/{launcher}/task/{launcher}/children") as f:
        siblings = [int(p) for p in f.read().split() if int(p) != os.getpid()]
    engine.add_request(_prompt(30, 1), SamplingParams(max_tokens=200, ignore_eos=True))
    engine.step()
    for pid in siblings:
        os.kill(pid, signal.SIGKILL)
    while True:  # the next collective fails (or the launcher stops this rank first)
        engine.step()


@slow_tp
@pytest.mark.skipif(
    not os.path.exists(f"/proc/{os.getpid()}/task/{os.getpid()}/children"), reason="needs /proc children"
)
def test_dying_rank_takes_the_group_down(tiny):
    t0 = time.monotonic()
    code = launch(_config(tiny, 2), kill_a_follower_then_step)
    assert code != 0  # the server exits with an error (a supervisor restarts it); nothing hangs
    assert time.monotonic() - t0 < 600


@slow_tp
def test_rank0_serves_grpc(tmp_path):
    """``chainkv serve --tensor-parallel-size 3`` on SmolLM2 (3 kv-heads: one per rank): rank 0 serves
    two turns of a session (the second reuses the first's KV) and SIGTERM drains and exits 0."""
    from sidecar_proc import Sidecar, request, run

    sidecar = Sidecar(f"file://{tmp_path}", "--tensor-parallel-size", "3").start()
    try:
        sidecar.wait_ready(600)
        first = run(sidecar.stub, request("tp-session", [("user", "Say hello.")]))
        second = run(sidecar.stub, request("tp-session", [("user", "And again.")]))
        assert len(first.token_ids) == len(second.token_ids) == 8
        assert second.usage.reused_tokens > 0
        code = sidecar.signal(signal.SIGTERM, timeout=120)
        assert code == 0, f"exit code {code}; the sidecar printed:\n" + "".join(sidecar.output)
    finally:
        if sidecar.proc.poll() is None:
            sidecar.proc.kill()
