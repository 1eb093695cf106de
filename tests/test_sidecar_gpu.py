"""The sidecar with the engine on a CUDA device: the engine thread drives Triton kernels, CUDA-graph
decode and one-step-ahead decoding; turns through gRPC equal turns run on the engine directly, a
cancelled turn is rolled back while a decode step is in flight, and a snapshot resumes on a
second engine.

Skipped without CUDA. Run on the GPU machine: ``python -m pytest -q tests/test_sidecar_gpu.py``.
"""

from __future__ import annotations

import time

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

import grpc  # noqa: E402

from engine.sampling import SamplingParams  # noqa: E402
from sidecar._proto.chainkv.v1 import sidecar_pb2 as pb  # noqa: E402
from sidecar._proto.chainkv.v1 import sidecar_pb2_grpc  # noqa: E402
from sidecar.turns.chat import ChatRenderer  # noqa: E402
from sidecar.grpc.server import ServerOptions, ServerThread  # noqa: E402
from sidecar.store import DirectoryStore  # noqa: E402
from tests.conftest import make_engine  # noqa: E402

pytestmark = pytest.mark.gpu

TURNS = [
    [("system", "You are a concise assistant."), ("user", "Name three fruits.")],
    [("user", "Which of them is yellow?")],
    [("user", "Thanks. One more?")],
]


@pytest.fixture(autouse=True)
def _needs_smollm2():
    from engine.model.loader import ModelLoadError, resolve_model_dir

    try:
        resolve_model_dir("smollm2")
    except ModelLoadError as e:
        pytest.skip(f"SmolLM2 is not available: {e}")


def test_gpu_turns_through_grpc_equal_direct_turns(tmp_path):
    engine = make_engine(None, device="cuda", num_pages=20000, prefill_chunk_size=256)
    assert engine.runner.graphs is not None
    server = ServerThread(engine, ServerOptions(port=0), DirectoryStore(tmp_path))
    port = server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = sidecar_pb2_grpc.SidecarStub(ch)
            got = []
            for t in TURNS:
                req = pb.TurnRequest(
                    session_id="g", messages=[pb.Message(role=r, content=c) for r, c in t], max_tokens=24
                )
                got.append(list(stub.Turn(req))[-1].completion)
            assert [c.usage.source_tier for c in got] == [pb.TIER_NEW, pb.TIER_GPU, pb.TIER_GPU]
            before = stub.GetSession(pb.GetSessionRequest(session_id="g"))
            call = stub.Turn(
                pb.TurnRequest(
                    session_id="g",
                    messages=[pb.Message(role="user", content="Count to 500.")],
                    max_tokens=2000,
                    ignore_eos=True,
                )
            )
            for n, _ in enumerate(call, 1):
                if n == 20:
                    call.cancel()
                    break
            deadline = time.monotonic() + 30
            while engine.stats().running and time.monotonic() < deadline:
                time.sleep(0.05)
            after = stub.GetSession(pb.GetSessionRequest(session_id="g"))
            assert after.digest == before.digest and after.turn_index == 3
            server.run(server.server.writer.flush(30))
    finally:
        server.stop(grace=2)

    # the same turns on the engine directly (another session id)
    direct = engine
    r = ChatRenderer(direct.tokenizer, direct.eos_token_ids)
    ends = False
    for i, (t, c) in enumerate(zip(TURNS, got)):
        msgs = [{"role": role, "content": text} for role, text in t]
        toks = r.first_turn(msgs).token_ids if i == 0 else r.continuation(msgs, ends).token_ids
        direct.add_turn("d", toks, SamplingParams(max_tokens=24))
        out = None
        while out is None:
            out = next((o for o in direct.step() if o.finished), None)
        assert out.token_ids == list(c.token_ids), f"turn {i}"
        ends = out.token_ids[-1] == r.end_of_turn_id

    # the snapshot the sidecar wrote resumes through a second sidecar (the engine forgot the session)
    engine.end_session("g")
    server2 = ServerThread(engine, ServerOptions(port=0), DirectoryStore(tmp_path))
    port = server2.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            info = sidecar_pb2_grpc.SidecarStub(ch).Resume(pb.ResumeRequest(session_id="g", expected_turn_index=3))
            assert info.source_tier == pb.TIER_STORE and info.turn_index == 3
    finally:
        server2.stop(grace=2)
