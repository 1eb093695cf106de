"""KV quantization methods (kivi, fp8) on SmolLM2: agreement with dense over 64 greedy tokens, bytes per
cached token from the pool's own accounting, sessions (multi-turn, fork, snapshot/restore) on
quantized pages, clear errors, and the CLI / sidecar surface.

kivi keeps the last ``residual_length`` tokens of every head in full precision (KIVI's R, default
128). On the 107-token agreement context that is the whole cache, so the quantizer itself is
measured there with R = 0 (only the open page exact); the paper's configuration (2 bits, R = 128)
is measured on a 400-token context where two thirds of the cache is quantized."""

from __future__ import annotations

import json
import subprocess
import sys

import grpc
import pytest
import torch

from engine.cache.formats import make_format
from engine.cache.manager import CacheManager
from engine.cache.pages import PagePool
from engine.cache.snapshot import SessionSnapshot
from engine.method_spec import MethodError, MethodSpec
from engine.sampling import SamplingParams

from benchmarks.quant_quality import agreement, forced_decode
from tests.conftest import first_turn, make_engine, next_turn, run_turn

pytestmark = pytest.mark.slow

N_TOKENS = 64
GREEDY = SamplingParams(max_tokens=6)
AGREEMENT_PROMPT = [{"role": "user", "content": "Explain photosynthesis to a ten-year-old in one paragraph."}]
SYSTEM = (
    "You are a helpful assistant. Here is the design note of the project the user asks about.\n\n"
    "chainkv is a sparse-first LLM inference engine packaged as an agent-runtime sidecar. An agent framework "
    "talks to it over gRPC, one long-lived session per agent run. The sidecar keeps that session's KV cache "
    "alive across turns (the Chain Cache), shrinks it with one of many sparse methods (physically: freed pages "
    "go back to the pool and let more sessions share the GPU), prunes old tool-call output from the cached "
    "history (Prefix-Cache Pruning), and snapshots the session to Redis so any replica can resume it. "
    "A PagePool per layer holds K and V pages in the model dtype, or a quantized layout with scales for KIVI "
    "and FP8 methods. Every (sequence, layer, kv-head) owns its own page list and length. Eviction compacts "
    "each head and returns the freed pages to the pool. Fork shares pages copy-on-write; snapshot and restore "
    "move a session's physical KV plus method state to and from host memory. Sessions move between tiers: "
    "active, idle on the GPU, host RAM, the store, and gone, in which case they are rebuilt by re-prefilling "
    "their token history. The session store is Redis in production and a local directory by default. "
    "Chunks are written first, then the metadata is committed by a Lua script that checks the generation."
)
QUESTION = "Explain in a few sentences what the Chain Cache is and where sessions are snapshotted."


QUANTIZED = dict(num_pages=6000, max_num_seqs=4, max_cached_seqs=8, prefill_chunk_size=128, max_num_batched_tokens=1024)
"""The SmolLM2 engine settings of the quantized-method fixtures (each adds its method)."""


@pytest.fixture(scope="module")
def kivi2():
    """The paper's configuration: 2 bits, value group 32, residual R = 128 (key group = page, 16)."""
    return make_engine(None, QUANTIZED, method="kivi", method_args={"bits": 2})


@pytest.fixture(scope="module")
def kivi2_r0():
    """2 bits without a residual window: every full page is quantized (sessions seal pages early)."""
    return make_engine(None, QUANTIZED, method="kivi", method_args={"bits": 2, "residual_length": 0})


@pytest.fixture(scope="module")
def kivi4():
    return make_engine(None, QUANTIZED, method="kivi", method_args={"bits": 4, "residual_length": 0})


@pytest.fixture(scope="module")
def fp8():
    return make_engine(None, QUANTIZED, method="fp8", method_args={})


def prompt(engine) -> list[int]:
    return engine.apply_chat_template([{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}])


@pytest.fixture(scope="module")
def dense_reference(smol_engine):
    """64 greedy tokens of the dense engine (float32, plain pages) and their logits. The prompt is
    short and the reply natural text (SmolLM2 falls into repetition on long contexts, which would
    make agreement trivial); most of the 107-token cache is the reply itself, read quantized."""
    ids = smol_engine.apply_chat_template(AGREEMENT_PROMPT)
    out = smol_engine.generate([ids], SamplingParams(max_tokens=N_TOKENS, ignore_eos=True, return_logits=True))[0]
    return ids, out.token_ids, out.step_logits


@pytest.fixture(scope="module")
def long_reference(smol_engine):
    """The same for the design-note prompt (336 tokens): 400 cached tokens per head at the end, of
    which R = 128 to 143 are in kivi's full-precision window."""
    ids = prompt(smol_engine)
    out = smol_engine.generate([ids], SamplingParams(max_tokens=N_TOKENS, ignore_eos=True, return_logits=True))[0]
    return ids, out.token_ids, out.step_logits


def agreement_with_dense(engine, reference, name: str) -> tuple[float, torch.Tensor, int]:
    """Top-1 agreement with the dense tokens, per-step KL(dense || engine), free-running prefix."""
    ids, tokens, dense_logits = reference
    agree, kl, prefix = agreement(dense_logits, forced_decode(engine, ids, tokens), tokens)
    print(
        f"\n{name}: top-1 agreement {agree:.4f} over {len(tokens)} tokens ({len(ids)} prompt tokens), "
        f"KL(dense||{name}) mean {kl.mean():.4f} max {kl.max():.4f}, free-running identical for the first {prefix} tokens"
    )
    return agree, kl, prefix


@pytest.mark.parametrize("name", ["kivi4", "fp8"])
def test_agrees_with_dense_over_64_greedy_tokens(name, dense_reference, request):
    """kivi at 4 bits without a residual window (every full page read quantized) and fp8 (e4m3)."""
    engine = request.getfixturevalue(name)
    agree, kl, _ = agreement_with_dense(engine, dense_reference, name)
    assert agree >= 0.95
    assert kl.mean() < 0.02
    assert not engine.pool.format.plain


def test_kivi2_with_the_papers_residual_window(kivi2, kivi2_r0, long_reference):
    """kivi at 2 bits, the paper's configuration (R = 128) against no window (R = 0), on a context
    where most of the cache is quantized. The window is what makes 2 bits usable here; on this
    135M-parameter model it still does not reach 0.95 (measured 0.84, KL 0.084; R = 0: 0.67, KL 0.33).
    Most of the remaining loss is the 2-bit keys (see docs/benchmarks.md)."""
    ids, tokens, _ = long_reference
    assert len(ids) + len(tokens) >= 3 * kivi2.pool.format.residual_length  # most tokens are quantized
    agree, kl, _ = agreement_with_dense(kivi2, long_reference, "kivi2 R=128")
    agree0, kl0, _ = agreement_with_dense(kivi2_r0, long_reference, "kivi2 R=0")
    assert agree >= 0.8 and kl.mean() < 0.12
    assert agree0 < agree and kl0.mean() > 2 * kl.mean()


@pytest.mark.parametrize("name,ratio", [("kivi2_r0", 0.3), ("kivi2", 0.7), ("fp8", 0.55)])
def test_multi_turn_session_reuses_kv_and_holds_fewer_bytes_per_token(name, ratio, request):
    """Bytes per cached token of a two-turn session (about 680 tokens per head), as the pool
    accounts them (page storage with scales and zero points, plus the full-precision staging page
    of every open or in-window page, in the engine's dtype: float32 here), against what the pool
    accounts for a bf16 plain page. With R = 128 the window is 9 float32 staging pages of a head's
    43, so kivi2 holds about 0.65x of bf16 at this context: below 0.3x only once R is amortized
    (next test)."""
    engine = request.getfixturevalue(name)
    t0 = prompt(engine)
    out0 = run_turn(engine, "bytes", t0, SamplingParams(max_tokens=4))
    t1 = next_turn(engine, "Now summarise this for a new engineer:\n" + SYSTEM)
    out1 = run_turn(engine, "bytes", t1, SamplingParams(max_tokens=4))
    hist = len(t0) + len(out0.token_ids)
    assert out1.counters.reused_tokens == hist - 1 and out1.counters.prefilled_tokens == len(t1) + 1
    tokens = int(engine.manager.seq_lengths("bytes").sum())
    per_token = engine.manager.kv_bytes("bytes") / tokens
    shape = engine.model_config
    bf16 = PagePool(1, engine.pool.page_size, shape.head_dim, torch.bfloat16, "cpu")
    print(
        f"\n{name}: {per_token:.1f} B per cached token (per layer and kv-head) over {tokens // (30 * 3)} tokens per head; "
        f"bf16 plain {bf16.bytes_per_token:.1f} B -> {per_token / bf16.bytes_per_token:.3f}x; "
        f"pool capacity cost {engine.pool.bytes_per_token:.1f} B/token"
    )
    assert per_token <= ratio * bf16.bytes_per_token
    engine.end_session("bytes")


@pytest.mark.parametrize("dtype,tokens", [(torch.float32, 4096), (torch.bfloat16, 2048)])
def test_kivi2_bytes_per_token_once_the_window_is_amortized(kivi2, dtype, tokens):
    """The paper's kivi2 (R = 128) holds at most 0.3x of a bf16 plain page per cached token once a
    head is long against R: a pool in the engine's kivi format (one layer and kv-head), filled with
    ``tokens`` tokens by the CacheManager, accounted by the pool. float32 is the CPU engine's dtype
    (float32 staging pages), bfloat16 the GPU's."""
    fmt = kivi2.pool.format
    P, D = fmt.page_size, fmt.head_dim
    f = make_format("kivi", fmt.args, P, D, dtype)
    pool = PagePool(tokens // P + 1, P, D, dtype, "cpu", format=f, max_open_pages=f.staging_per_head)
    mgr = CacheManager(pool, 1, 1, 1, tokens)
    mgr.open("long")
    g = torch.Generator().manual_seed(0)
    for start in range(0, tokens, 1024):
        slots = mgr.append(["long"], [1024], torch.arange(start, start + 1024))
        k, v = torch.randn(2, 1024, 1, D, generator=g).to(dtype)
        pool.write_tokens(slots[0], k, v)
    per_token = mgr.kv_bytes("long") / tokens
    bf16 = PagePool(1, P, D, torch.bfloat16, "cpu").bytes_per_token
    staged = f.num_open(mgr.tables[0, 0, : tokens // P].long())
    print(
        f"\nkivi2 R={f.residual_length} {dtype}: {per_token:.1f} B per cached token over {tokens} tokens "
        f"({staged} staged pages) -> {per_token / bf16:.3f}x of bf16"
    )
    assert staged == -(-f.residual_length // P)  # the window, and no more, is in full precision
    assert per_token <= 0.3 * bf16


def test_fork_and_snapshot_restore_with_quantized_pages(kivi2_r0):
    """kivi, the harder format (open pages in full-precision staging, sealed pages quantized; R = 0
    so that the short turns seal pages); fp8 pages fork, compact and snapshot in
    tests/test_kv_formats.py, the residual window in tests/test_kv_formats.py."""
    engine = kivi2_r0
    used0 = engine.pool.num_used
    staged0 = getattr(engine.pool.format, "num_staging_free", None)
    t0 = first_turn(engine, "Let's plan a trip. Suggest a city.")
    run_turn(engine, "p", t0, GREEDY)
    blob = engine.snapshot_session("p").to_bytes()
    engine.fork_session("p", "c")  # shares every page, the open (full-precision) ones included
    a, b = next_turn(engine, "Somewhere warm, please."), next_turn(engine, "Somewhere cold, please.")
    pa, cb = run_turn(engine, "p", a, GREEDY), run_turn(engine, "c", b, GREEDY)
    assert cb.counters.reused_tokens == pa.counters.reused_tokens
    # the same turns on sessions restored from the snapshot bytes give the same tokens: the fork's
    # copy-on-write kept parent and child apart, and restore re-quantizes the pages losslessly
    for sid, turn, expect in (("p2", a, pa), ("c2", b, cb)):
        snap = SessionSnapshot.from_bytes(blob)
        snap.meta["session_id"] = sid
        engine.load_session(snap)
        again = run_turn(engine, sid, turn, GREEDY)
        assert again.source_tier == "store" and again.counters.prefilled_tokens == len(turn) + 1
        assert again.token_ids == expect.token_ids
    for sid in ("p", "c", "p2", "c2"):
        engine.end_session(sid)
    assert engine.pool.num_used == used0
    assert getattr(engine.pool.format, "num_staging_free", None) == staged0


def test_abort_rolls_back_quantized_pages(kivi2_r0):
    eng = kivi2_r0
    t0 = first_turn(eng, "Hello there.")
    out = run_turn(eng, "ab", t0, GREEDY)
    hist = t0 + out.token_ids
    digest = eng.session_info("ab").digest
    eng.add_turn("ab", next_turn(eng, "Count to fifty."), SamplingParams(max_tokens=40))
    for _ in range(3):
        eng.step()
    eng.abort("ab")  # truncates every head back to the history (a sealed page may reopen)
    assert eng.session_info("ab").digest == digest
    assert eng.manager.seq_lengths("ab").max() <= len(hist)
    nxt = next_turn(eng, "What is your name?")
    again = run_turn(eng, "ab", nxt, GREEDY)
    assert again.counters.reused_tokens >= len(hist) - 1 and again.counters.prefilled_tokens <= len(nxt) + 1
    eng.end_session("ab")


def test_unsupported_combinations_are_clear_errors(kivi2, smol_engine):
    ids = first_turn(kivi2, "hi")
    with pytest.raises(MethodError, match=r"stores KV as plain pages, but this engine's page pool holds kivi\(bits=2"):
        kivi2.add_request(ids, method=MethodSpec("dense"))
    with pytest.raises(MethodError, match="kivi.*bits=4.*holds kivi\\(bits=2"):
        kivi2.add_turn("x", ids, method=MethodSpec("kivi", method_args={"bits": 4}))
    with pytest.raises(MethodError, match="takes no budget"):
        kivi2.add_request(ids, method=MethodSpec("kivi", budget=64, method_args={"bits": 2}))
    with pytest.raises(MethodError, match="2 or 4"):
        kivi2.add_request(ids, method=MethodSpec("kivi", method_args={"bits": 3}))
    with pytest.raises(MethodError, match="divide head_dim"):
        kivi2.add_request(ids, method=MethodSpec("kivi", method_args={"bits": 2, "value_group": 48}))
    with pytest.raises(AttributeError, match="no plain K tensor"):
        kivi2.pool.k
    # a quantized session's snapshot cannot be resumed by an engine whose pool is plain
    run_turn(kivi2, "q", ids, GREEDY)
    snap = kivi2.snapshot_session("q")
    kivi2.end_session("q")
    with pytest.raises(MethodError, match=r"method 'kivi' stores KV as kivi\(bits=2.*holds plain pages"):
        smol_engine.load_session(snap)


def test_cli_generate_and_help_list_the_quantization_methods(generate_help):
    assert "kivi" in generate_help and "bits=2" in generate_help and "fp8=e4m3" in generate_help
    cmd = [
        sys.executable,
        "-m",
        "sidecar.cli",
        "generate",
        "--method",
        "kivi",
        "--method-arg",
        "bits=2",
        "--chat",
        "--json",
        "--max-tokens",
        "8",
        "--num-pages",
        "2000",
        "--max-cached-seqs",
        "64",
        "What is the capital of France?",
    ]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert "Paris" in out["text"]
    bad = subprocess.run([c if c != "bits=2" else "bits=3" for c in cmd], capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "kivi.bits must be 2 or 4" in bad.stderr


def test_sidecar_serves_a_kivi_session(kivi2, tmp_path):
    from sidecar._proto.chainkv.v1 import sidecar_pb2 as pb
    from sidecar._proto.chainkv.v1 import sidecar_pb2_grpc
    from sidecar.grpc.server import ServerOptions, ServerThread
    from sidecar.store import DirectoryStore

    server = ServerThread(kivi2, ServerOptions(port=0), DirectoryStore(tmp_path))
    port = server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = sidecar_pb2_grpc.SidecarStub(channel)

            def turn(session, role, text, **kw):
                req = pb.TurnRequest(
                    session_id=session, messages=[pb.Message(role=role, content=text)], max_tokens=8, **kw
                )
                return list(stub.Turn(req))[-1].completion

            first = turn("s", "user", "Name three fruits.")
            second = turn("s", "user", "Which of them is yellow?")
            assert first.usage.generated_tokens > 0 and second.usage.reused_tokens > 0
            assert second.usage.source_tier == pb.TIER_GPU
            with pytest.raises(grpc.RpcError) as err:
                turn("d", "user", "hi", method="dense")
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "kivi" in err.value.details()
    finally:
        server.stop(grace=2)
        for sid in list(kivi2.chains.chains):
            kivi2.end_session(sid)
