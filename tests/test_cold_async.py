"""The cold tier's copies off the engine thread (engine/cache/cold_copy.py): results equal to the
synchronous path, pending copies flushed where they are read, nothing left behind by an abort or an
end, the host bound, and the traffic counters.

Without CUDA every copy completes at once; ``GatedCopier`` keeps a copy to the host in flight on
the CPU (its completion passes only after a number of polls, or when waited for), so the store's
bookkeeping of copies in flight runs here as it does on a GPU. The CUDA tests run the real side
stream and skip without a GPU.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict

import pytest
import torch

from engine.cache.cold_copy import ColdCopier, HostCopy
from engine.cache.cold_store import FP8, ColdStore
from engine.config import EngineConfig
from engine.method_spec import MethodSpec
from engine.llm import LLMEngine
from engine.sampling import SamplingParams

from agent_adapters.messages import Usage
from sidecar._proto.chainkv.v1 import sidecar_pb2 as pb
from tests.conftest import run_turn

GREEDY = SamplingParams(max_tokens=6, ignore_eos=True)
L, H, D, P = 2, 3, 8, 4
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


class Gate:
    """A copy's completion that passes after ``polls`` queries (or at once when waited for)."""

    def __init__(self, polls: int):
        self.left = polls
        self.forced = False
        """Waited for before it had passed by itself."""

    @property
    def passed(self) -> bool:
        return self.left < 0 or self.forced

    def query(self) -> bool:
        self.left -= 1
        return self.passed

    def synchronize(self) -> None:
        self.forced |= not self.passed


class GatedCopier(ColdCopier):
    """CPU copies to the host that stay in flight for ``polls`` polls (copies to the device: at
    once); ``writer``: staged values are written on a writer thread, as on CUDA."""

    def __init__(self, polls: int = 10**9, writer: bool = False):
        super().__init__(torch.device("cpu"))
        self.polls = polls
        self.gates: list[Gate] = []
        if writer:
            self.writer = ThreadPoolExecutor(1, thread_name_prefix="test-cold-writer")

    def to_host(self, tensors):
        self.gates.append(Gate(self.polls))
        return HostCopy(host=[t.clone() for t in tensors], device=list(tensors), done=self.gates[-1])


def _batches(seed: int, rounds: int = 4):
    """Appends of random tokens to every row: (rows, k, v, pos) per round."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for r in range(rounds):
        n = torch.randint(1, 7, (L * H,), generator=g)
        rows = torch.arange(L * H).repeat_interleave(n)
        pos = torch.cat([torch.arange(int(m)) + 100 * r for m in n])
        out.append((rows, torch.randn(len(rows), D, generator=g), torch.randn(len(rows), D, generator=g), pos))
    return out


def _store(fmt: str, copier=None) -> ColdStore:
    return ColdStore(L, H, D, P, torch.float32, torch.device("cpu"), fmt, copier)


def _same_state(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        x, y = (t.view(torch.uint8) if t.dtype == FP8 else t for t in (a[k], b[k]))
        assert torch.equal(x, y), k


# --- 1. the store ----------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt, writer", [("plain", False), ("fp8", False), ("plain", True)])
def test_copies_in_flight_give_what_the_synchronous_store_gives(fmt, writer):
    sync, gated = _store(fmt), _store(fmt, GatedCopier(polls=1, writer=writer))
    q = torch.randn(L, H, 5, D)
    parts = 5 if fmt == "fp8" else 3  # k, v, positions (and fp8's scales)
    for batch in _batches(0):
        for s in (sync, gated):
            s.append(*batch)
        # the latest copy is in flight (a growth of the store lands the earlier ones first)
        assert gated.pending and 0 < gated.staging_buffers <= parts * len(gated.pending)
        assert len(sync.pending) == 0  # without CUDA the copy is done before append returns
        assert torch.equal(sync.block_scores(q), gated.block_scores(q))  # bookkeeping is at once
        assert sync.live_tokens() == gated.live_tokens()
    blocks = sync.block_scores(q).topk(2, -1).indices
    a, b = sync.take(blocks), gated.take(blocks)
    assert torch.equal(a.k, b.k) and torch.equal(a.v, b.v) and torch.equal(a.pos, b.pos)
    _same_state(sync.state(), gated.state())
    assert len(gated.pending) == 0 and gated.staging_buffers == 0


def test_a_fetch_waits_only_for_the_copies_into_its_blocks():
    copier = GatedCopier()
    store = _store("plain", copier)
    first = (torch.tensor([0, 0, 0, 0]), torch.randn(4, D), torch.randn(4, D), torch.arange(4))
    second = (torch.tensor([5, 5]), torch.randn(2, D), torch.randn(2, D), torch.arange(2) + 50)
    store.append(*first)
    store.append(*second)
    blocks = torch.full((L, H, 1), -1)
    blocks[0, 0, 0] = 0  # row 0's block 0: written by the first copy only
    got = store.take(blocks)
    assert torch.equal(got.k[0, 0], first[1]) and got.pos[0, 0].tolist() == [0, 1, 2, 3]
    assert copier.gates[0].forced and not copier.gates[1].passed
    assert len(store.pending) == 1  # the second copy is still in flight
    store.flush()
    assert store.pos[1, 2, :2].tolist() == [50, 51]


@pytest.mark.parametrize("writer", [False, True])
def test_poll_writes_the_copies_that_have_run_and_never_waits(writer):
    copier = GatedCopier(polls=1, writer=writer)
    store = _store("plain", copier)
    rows, k, v, pos = _batches(1, 1)[0]
    store.append(rows, k, v, pos)  # append's own poll: the first query, not yet
    assert len(store.pending) == 1
    store.poll()  # the second query: the copy has run (and is written, or handed to the writer)
    for p in store.pending:  # on the writer thread: wait for the write here (poll never does)
        p.writing.result()
    store.poll()  # written copies are forgotten
    assert len(store.pending) == 0 and not copier.gates[0].forced
    assert torch.equal(store.pos[0, 0, : int((rows == 0).sum())], pos[rows == 0].to(torch.int32))


def test_discarding_a_store_with_copies_in_flight_leaves_no_buffer():
    copier = GatedCopier()
    store = _store("fp8", copier)
    for batch in _batches(2):
        store.append(*batch)
    assert store.pending and store.staging_buffers == 5 * len(store.pending)
    assert not all(g.passed for g in copier.gates)
    store.discard()
    assert len(store.pending) == 0 and store.staging_buffers == 0
    assert all(g.passed for g in copier.gates)  # each copy had run before its buffers were let go


# --- 2. the engine ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_path(tiny_models):
    return tiny_models("llama")[0]


def _engine(path, polls: int | None = None, writer: bool = False, **kw) -> LLMEngine:
    base = dict(model=path, device="cpu", num_pages=4000, page_size=4, prefill_chunk_size=64)
    engine = LLMEngine(EngineConfig(**{**base, **kw}))
    if polls is not None:
        engine.controller.recall.copier = GatedCopier(polls, writer)
    return engine


def _turns(seed: int, sizes=(90, 40, 40, 40)) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 300, (n,), generator=g).tolist() for n in sizes]


def _chat(engine, sid, turns, spec):
    return [run_turn(engine, sid, t, GREEDY, method=spec if i == 0 else None).token_ids for i, t in enumerate(turns)]


@pytest.mark.parametrize(
    "method, args, polls, writer",  # polls: copies that run within a few steps, never by themselves, at once
    [
        ("snapkv+recall", {}, 3, True),
        pytest.param(
            "streaming_llm+recall", {"recall_interval": 2, "cold_format": "fp8"}, 10**9, False, marks=pytest.mark.slow
        ),
        pytest.param("h2o+recall", {"recall_interval": 3}, 0, False, marks=pytest.mark.slow),
    ],
)
def test_engine_tokens_equal_the_synchronous_path(tiny_path, method, args, polls, writer):
    spec = MethodSpec(method, budget=24, method_args=args)
    turns = _turns(3)
    sync, gated = _engine(tiny_path), _engine(tiny_path, polls, writer)
    assert _chat(gated, "s", turns, spec) == _chat(sync, "s", turns, spec)
    a, b = sync.controller.recall, gated.controller.recall
    assert a.recalls > 0 and a.traffic == b.traffic
    assert a.cold_tokens("s") == b.cold_tokens("s")


def test_a_snapshot_taken_with_copies_in_flight_holds_their_tokens(tiny_path):
    spec = MethodSpec("snapkv+recall", budget=24)
    turns = _turns(4)
    ref = _engine(tiny_path)
    want = _chat(ref, "s", turns, spec)
    a = _engine(tiny_path, polls=10**9)
    assert _chat(a, "s", turns[:2], spec) == want[:2]
    assert a.controller.recall.staging_buffers > 0  # turn 2's captures are still in flight
    snap = a.snapshot_session("s")
    b = _engine(tiny_path)
    b.load_session(snap)
    assert [run_turn(b, "s", t, GREEDY).token_ids for t in turns[2:]] == want[2:]
    assert b.controller.recall.cold_tokens("s") == ref.controller.recall.cold_tokens("s")


def test_end_session_and_abort_with_copies_in_flight_leave_no_buffer(tiny_path):
    engine = _engine(tiny_path, polls=10**9)
    copier = engine.controller.recall.copier
    spec = MethodSpec("snapkv+recall", budget=24)
    turns = _turns(5)
    _chat(engine, "e", turns[:2], spec)
    assert engine.controller.recall.staging_buffers > 0
    engine.end_session("e")
    assert engine.controller.recall.staging_buffers == 0 and "e" not in engine.controller.recall.stores
    # a turn aborted while its input's captures are in flight
    run_turn(engine, "a", turns[0], GREEDY, method=spec)
    engine.add_turn("a", turns[1], GREEDY)
    while not engine.controller.recall.stores["a"].pending or engine.chains.chains["a"].seq.num_cached < 100:
        engine.step()
    engine.abort("a")
    engine.end_session("a")
    assert engine.controller.recall.staging_buffers == 0 and engine.controller.recall.stores == {}
    assert all(g.passed for g in copier.gates)


def test_host_bound_holds_with_copies_in_flight(tiny_path):
    engine = _engine(tiny_path, polls=10**9, recall_host_gb=4096 / 2**30)
    tier = engine.controller.recall
    peak = []
    orig = tier._append

    def append(*a):
        n = orig(*a)
        peak.append(tier.host_bytes)
        return n

    tier._append = append
    out = _chat(engine, "s", _turns(7), MethodSpec("snapkv+recall", budget=16))
    assert all(len(o) == GREEDY.max_tokens for o in out)
    assert max(peak) <= tier.host_limit and tier.dropped_tokens > 0


def test_traffic_counts_every_byte_and_page_and_is_reported_per_turn(tiny_path):
    engine = _engine(tiny_path)
    tier = engine.controller.recall
    # recall_scope=earlier: turn 1 has nothing an earlier turn evicted, so it fetches nothing
    spec = MethodSpec("snapkv+recall", budget=24, method_args={"recall_scope": "earlier"})
    turns = _turns(6, (90, 40, 40))
    shape = tier.shape
    token_bytes = 2 * shape.head_dim * engine.manager.pool.dtype.itemsize + 4  # k, v, an int32 position
    reports = []
    for i, t in enumerate(turns):
        before = tier.traffic.d2h_bytes, tier.traffic.h2d_bytes, tier.traffic.pages_fetched
        run_turn(engine, "s", t, GREEDY, method=spec if i == 0 else None)
        info = engine.session_info("s").recall
        after = tier.traffic.d2h_bytes, tier.traffic.h2d_bytes, tier.traffic.pages_fetched
        assert (info.d2h_bytes, info.h2d_bytes, info.pages_fetched) == tuple(x - y for x, y in zip(after, before))
        reports.append(info)
    assert tier.traffic.d2h_bytes == (tier.captured_tokens + tier.returned_tokens) * token_bytes
    assert tier.traffic.h2d_bytes == tier.traffic.pages_fetched * shape.page_size * token_bytes
    assert reports[0].h2d_bytes == 0 and reports[0].d2h_bytes > 0  # turn 1: nothing cold to recall yet
    assert sum(r.recalls for r in reports) == tier.recalls > 0
    # the last turn's record reaches a client: session info -> chainkv.v1.Usage.recall -> Usage.recall
    typed = engine.session_info("s").recall
    assert Usage.from_proto(pb.Usage(recall=pb.RecallTraffic(**asdict(typed)))).recall == asdict(reports[-1])
    stats = engine.stats()
    assert stats.recall_d2h_bytes == tier.traffic.d2h_bytes and stats.recall_h2d_bytes == tier.traffic.h2d_bytes
    assert stats.recall_staging_buffers == 0


def test_without_recall_nothing_is_copied(tiny_path):
    engine = _engine(tiny_path)
    _chat(engine, "s", _turns(8)[:2], MethodSpec("snapkv", budget=24))
    assert engine.controller.recall.stores == {} and engine.stats().recall_d2h_bytes == 0
    assert engine.session_info("s").recall.d2h_bytes == 0


# --- 3. CUDA: the side stream ------------------------------------------------------------------------
@CUDA
@pytest.mark.parametrize("fmt", ["plain", "fp8"])
def test_cuda_side_stream_copies_equal_the_cpu_store(fmt):
    dev = torch.device("cuda")
    cpu, gpu = _store(fmt), ColdStore(L, H, D, P, torch.float32, dev, fmt)
    assert gpu.copier.stream is not None
    for rows, k, v, pos in _batches(3):
        cpu.append(rows, k, v, pos)
        gpu.append(rows, k.to(dev), v.to(dev), pos.to(dev))
    q = torch.randn(L, H, 5, D)
    # the bounds are exact on both; their matmul by q may sum in another order on the GPU
    assert torch.allclose(cpu.block_scores(q), gpu.block_scores(q.to(dev)).cpu(), atol=1e-5)
    blocks = cpu.block_scores(q).topk(2, -1).indices
    a, fetch = cpu.take(blocks), gpu.fetch(blocks)
    b = fetch.wait()
    assert b.k.device.type == "cuda"
    assert torch.equal(a.k, b.k.cpu()) and torch.equal(a.v, b.v.cpu()) and torch.equal(a.pos, b.pos.cpu())
    _same_state(cpu.state(), gpu.state())
    assert gpu.staging_buffers == 0
    for batch in _batches(4):
        gpu.append(*(t.to(dev) if i else t for i, t in enumerate(batch)))
    gpu.discard()
    assert gpu.staging_buffers == 0 and len(gpu.pending) == 0


@CUDA
def test_cuda_engine_tokens_equal_with_the_side_stream_and_without(tiny_path):
    spec = MethodSpec("snapkv+recall", budget=24, method_args={"recall_interval": 2})
    turns = _turns(9)
    side = _engine(tiny_path, device="cuda")
    inline = _engine(tiny_path, device="cuda")
    inline.controller.recall.copier = ColdCopier(torch.device("cuda"))
    inline.controller.recall.copier.stream = None  # the same copies, made at once on the compute stream
    inline.controller.recall.copier.writer = None
    assert _chat(side, "s", turns, spec) == _chat(inline, "s", turns, spec)
    assert side.controller.recall.traffic == inline.controller.recall.traffic
    assert side.controller.recall.recalls > 0
    side.end_session("s")
    assert side.controller.recall.staging_buffers == 0
