"""Quantized KV pages (kivi, fp8) on a CUDA device: the Triton backend dequantizes, then attends.

Skipped without CUDA. Run on the GPU machine: ``python -m pytest -q tests/test_quant_gpu.py``.
"""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

from engine.cache.formats import make_format  # noqa: E402
from engine.cache.pages import PagePool  # noqa: E402
from engine.sampling import SamplingParams  # noqa: E402

from benchmarks.quant_quality import forced_decode  # noqa: E402
from tests.conftest import make_engine, run_turn  # noqa: E402

pytestmark = pytest.mark.gpu

# kivi with a short residual window (R = 32), so that most of the 150-token prompt is read quantized
CASES = [
    ("kivi", {"bits": 2, "value_group": 16, "residual_length": 32}),
    ("kivi", {"bits": 4, "value_group": 16, "residual_length": 32}),
    ("fp8", {}),
]


QUANTIZED = dict(
    dtype="float32",
    num_pages=4096,
    page_size=16,
    prefill_chunk_size=64,
    max_num_batched_tokens=256,
    max_num_seqs=4,
    max_cached_seqs=8,
)
"""The engine settings of both sides of a comparison (each adds its device and method)."""


@pytest.mark.parametrize("method,args", CASES)
def test_gpu_dequantized_attention_matches_the_cpu_reference(tiny_models, method, args):
    """The GPU engine (Triton backend, quantized pool on the device) against the CPU engine with the
    same format: their logits differ far less than quantization moves them from dense."""
    path, _ = tiny_models("llama")
    gpu = make_engine(path, QUANTIZED, device="cuda", method=method, method_args=args)
    assert gpu.backend.name == "triton" and not gpu.pool.format.plain
    assert gpu.runner.graphs is None  # CUDA graphs read plain pages only: off for quantized pools
    prompt = torch.randint(0, 320, (150,), generator=torch.Generator().manual_seed(3)).tolist()
    out = gpu.generate([prompt], SamplingParams(max_tokens=24, ignore_eos=True, return_logits=True))[0]
    cpu = forced_decode(
        make_engine(path, QUANTIZED, device="cpu", method=method, method_args=args), prompt, out.token_ids
    )
    dense = forced_decode(
        make_engine(path, QUANTIZED, device="cpu", method="dense", method_args={}), prompt, out.token_ids
    )
    same_format = (out.step_logits.float() - cpu).abs().mean().item()
    quant_error = (dense - cpu).abs().mean().item()
    assert quant_error > 0
    assert same_format < 0.1 * quant_error, (same_format, quant_error)


@pytest.mark.parametrize(
    "method,args,ratio", [("fp8", {}, 0.55), ("kivi", {"bits": 2}, 0.3), ("kivi", {"bits": 4}, 0.45)]
)
def test_gpu_pool_memory_is_really_smaller(method, args, ratio):
    """Device memory the pool allocates, measured by the CUDA allocator, is its accounting and a
    fraction of a bf16 pool's (Llama-3 shapes: head_dim 128, 32-token pages)."""
    dev = torch.device("cuda")

    def build(name, a):
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        before = torch.cuda.memory_allocated(dev)
        fmt = make_format(name, a, 32, 128, torch.bfloat16)
        pool = PagePool(
            20000, 32, 128, torch.bfloat16, dev, format=fmt, max_open_pages=1025
        )  # 32 sequences x 32 layers
        torch.cuda.synchronize()
        return pool, torch.cuda.memory_allocated(dev) - before

    plain, plain_bytes = build("plain", {})
    pool, used = build(method, args)
    # the allocator hands out whole blocks (a large tensor's is rounded up to 2 MiB): allow one
    # block's rounding on top of 1%
    slack = 2 * 2**20
    assert abs(used - pool.storage_bytes) <= 0.01 * used + slack
    assert abs(plain_bytes - plain.storage_bytes) <= 0.01 * plain_bytes + slack
    assert pool.bytes_per_page <= ratio * plain.bytes_per_page
    assert used <= ratio * plain_bytes


def test_gpu_kivi_sessions_fork_and_snapshot(tiny_models):
    from engine.cache.snapshot import SessionSnapshot

    path, _ = tiny_models("llama")
    # R = 32: the 70-token turns both seal pages and keep some in the window
    eng = make_engine(
        path, QUANTIZED, device="cuda", method="kivi", method_args={"bits": 2, "value_group": 16, "residual_length": 32}
    )
    g = torch.Generator().manual_seed(4)
    t0 = torch.randint(0, 320, (70,), generator=g).tolist()
    a, b = torch.randint(0, 320, (9,), generator=g).tolist(), torch.randint(0, 320, (11,), generator=g).tolist()
    params = SamplingParams(max_tokens=6, ignore_eos=True)

    run_turn(eng, "p", t0, params)
    blob = eng.snapshot_session("p").to_bytes()
    eng.fork_session("p", "c")
    pa, cb = run_turn(eng, "p", a, params), run_turn(eng, "c", b, params)
    for sid, tokens, expect in (("p2", a, pa), ("c2", b, cb)):
        snap = SessionSnapshot.from_bytes(blob)
        snap.meta["session_id"] = sid
        eng.load_session(snap)
        assert run_turn(eng, sid, tokens, params).token_ids == expect.token_ids
    for sid in ("p", "c", "p2", "c2"):
        eng.end_session(sid)
    assert eng.pool.num_used == 0
