"""Hypothesis fuzzing of every Sidecar RPC's fields, of chat content (special tokens, tool-call markup,
any Unicode) and of raw request bytes. Every call ends OK or with a documented status code (never
INTERNAL or UNKNOWN), the right one where the input decides it (bad token -> UNAUTHENTICATED, bad
session id -> INVALID_ARGUMENT), and the server stays SERVING.

CI runs a modest, derandomized number of examples; ``CHAINKV_FUZZ_EXAMPLES=N`` runs N per RPC with
fresh randomness.
"""

from __future__ import annotations

import os

import grpc
import pytest
from google.protobuf.message import DecodeError
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sidecar._proto.chainkv.v1 import sidecar_pb2 as pb
from sidecar._proto.chainkv.v1 import sidecar_pb2_grpc
from sidecar.session_ids import SESSION_ID_RE

from tests.sidecar_proc import serving

pytestmark = [pytest.mark.slow, pytest.mark.reliability]

C = grpc.StatusCode
ALLOWED = {
    C.INVALID_ARGUMENT,
    C.NOT_FOUND,
    C.ALREADY_EXISTS,
    C.ABORTED,
    C.FAILED_PRECONDITION,
    C.RESOURCE_EXHAUSTED,
    C.UNAUTHENTICATED,
    C.UNAVAILABLE,
}
GOOD = [("authorization", "Bearer tok-fuzz")]
EXAMPLES = int(os.environ.get("CHAINKV_FUZZ_EXAMPLES", "0"))
FUZZ = settings(
    max_examples=EXAMPLES or 20,
    deadline=None,
    derandomize=not EXAMPLES,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture, HealthCheck.data_too_large],
)

SPECIAL = [
    "<|im_start|>",
    "<|im_end|>",
    "<|endoftext|>",
    "<tool_call>",
    "</tool_call>",
    '<tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>',
    "<tool_call>{not json</tool_call>",
    "{{",
    "}}",
    "{% if %}",
    "\x00",
    "\ud7ff",
    "\U0001f600",
    "\u202e",
    "assistant\n",
    "\r\n",
]
content = st.lists(st.one_of(st.text(max_size=24), st.sampled_from(SPECIAL)), max_size=4).map("".join)
ids = st.one_of(
    st.sampled_from(["s1", "s2", "s1", "s2", "fz.3", "a" * 128, "a" * 129, "", "x/y", "{t}", "é"]),
    st.text(max_size=20),
    st.from_regex(SESSION_ID_RE, fullmatch=True),
)
metadata = st.one_of(
    st.just(GOOD),
    st.sampled_from(
        [GOOD, None, [("authorization", "Bearer nope")], [("authorization", "Basic x")], [("authorization", "Bearer ")]]
    ),
)
maybe = lambda s: st.one_of(st.none(), s)  # noqa: E731
floats = st.floats(allow_nan=True, allow_infinity=True)
u32 = st.integers(0, 2**32 - 1)

tool_call = st.builds(
    pb.ToolCall,
    id=st.text(max_size=8),
    name=st.one_of(st.just("lookup"), st.text(max_size=8)),
    arguments_json=st.one_of(st.just('{"q": "x"}'), st.just("[]"), st.text(max_size=16)),
)
message = st.builds(
    pb.Message,
    role=st.one_of(st.sampled_from(["user", "user", "system", "assistant", "tool"]), st.text(max_size=8)),
    content=content,
    name=st.text(max_size=8),
    tool_call_id=st.text(max_size=8),
    tool_calls=st.lists(tool_call, max_size=2),
)
tool = st.builds(
    pb.Tool,
    name=st.one_of(st.just("lookup"), st.text(max_size=10)),
    description=st.text(max_size=20),
    parameters_json=st.one_of(
        st.just(""), st.just('{"type": "object", "properties": {"q": {"type": "string"}}}'), st.text(max_size=20)
    ),
)


@st.composite
def turn_requests(draw):
    user = st.builds(pb.Message, role=st.just("user"), content=content)
    fields = dict(
        session_id=draw(st.one_of(st.sampled_from(["w1", "w2"]), ids)),
        request_id=draw(st.one_of(st.just(""), ids)),
        messages=draw(st.one_of(st.lists(user, min_size=1, max_size=2), st.lists(message, max_size=3))),
        tools=draw(st.one_of(st.just([]), st.lists(tool, max_size=2))),
        stop=draw(st.lists(st.text(max_size=6), max_size=3)),
        ignore_eos=draw(st.booleans()),
        method=draw(st.sampled_from(["", "", "dense", "streaming_llm", "snapkv", "no_such", "h2o"])),
        method_args=draw(
            st.dictionaries(st.sampled_from(["window", "sink", "x", ""]), st.text(max_size=5), max_size=2)
        ),
    )
    optional = dict(
        expected_turn_index=maybe(st.integers(-2, 4)),
        max_tokens=maybe(st.integers(-2, 5)),
        temperature=maybe(floats),
        top_k=maybe(st.integers(-3, 50)),
        top_p=maybe(floats),
        seed=maybe(st.integers(-(2**63), 2**63 - 1)),
        budget=maybe(st.integers(-5, 300)),
        budget_ratio=maybe(floats),
        shared_prefix_messages=maybe(st.integers(0, 5)),
    )
    for k, strat in optional.items():
        v = draw(strat) if draw(st.integers(0, 4)) == 0 else None  # each set one time in five
        if v is not None:
            fields[k] = v
    return pb.TurnRequest(**fields)


@st.composite
def chat_turns(draw):
    """Mostly well-formed turns whose chat content is fuzzed: they run the model (a few tokens)."""
    roles = st.sampled_from(["user", "user", "tool", "system", "assistant"])
    msgs = draw(st.lists(st.builds(pb.Message, role=roles, content=content), min_size=1, max_size=2))
    return pb.TurnRequest(
        session_id=draw(st.sampled_from(["c1", "c2", "c3"])),
        messages=msgs,
        max_tokens=draw(st.integers(1, 4)),
        ignore_eos=draw(st.booleans()),
        stop=draw(st.lists(st.sampled_from(["\n", ".", "<tool_call>", "a"]), max_size=2)),
    )


UNARY = {
    "GetServerInfo": st.builds(pb.GetServerInfoRequest),
    "Resume": st.builds(pb.ResumeRequest, session_id=ids, expected_turn_index=maybe(st.integers(-2, 4))),
    "GetSession": st.builds(pb.GetSessionRequest, session_id=ids),
    "EndSession": st.builds(pb.EndSessionRequest, session_id=ids, keep_snapshot=st.booleans()),
    "ForkSession": st.builds(pb.ForkSessionRequest, session_id=ids, new_session_id=ids),
    "PruneHistory": st.builds(
        pb.PruneHistoryRequest,
        session_id=ids,
        start=st.one_of(st.integers(0, 64), u32),
        end=st.one_of(st.integers(0, 64), u32),
        prune_roles=st.lists(st.sampled_from(["tool", "user", "assistant", "system", "x"]), max_size=2),
        prune_lag=maybe(u32),
        prune_policy=st.sampled_from(["", "drop", "keep_ratio", "zap"]),
        prune_keep_ratio=maybe(floats),
        prune_scope=st.sampled_from(["", "global", "per_head", "?"]),
    ),
}


@pytest.fixture(scope="module")
def fuzz_server(smol_engine, tmp_path_factory, reliability_report):
    from sidecar.grpc.auth import Authenticator
    from sidecar.turns.protocol import Limits
    from sidecar.grpc.server import ServerOptions, ServerThread
    from sidecar.store import DirectoryStore

    options = ServerOptions(
        port=0,
        auth=Authenticator({"tok-fuzz": "fuzz"}),
        resume_wait_s=0.1,
        limits=Limits(default_max_tokens=4),
        max_message_bytes=1 << 16,
    )
    server = ServerThread(smol_engine, options, DirectoryStore(tmp_path_factory.mktemp("fuzz-store")))
    port = server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    # a few sessions for the fuzzed calls to find
    stub = sidecar_pb2_grpc.SidecarStub(channel)
    for sid in ("s1", "s2"):
        list(
            stub.Turn(
                pb.TurnRequest(session_id=sid, messages=[pb.Message(role="user", content="Hi")], max_tokens=3),
                metadata=GOOD,
            )
        )
    yield stub, channel
    channel.close()
    server.stop(grace=2)
    for sid in list(smol_engine.chains.chains):
        smol_engine.end_session(sid)


def expected_code(request, md) -> grpc.StatusCode | None:
    """The code the input alone decides, if any."""
    if md is not GOOD:
        return C.UNAUTHENTICATED
    sid = getattr(request, "session_id", None)
    if sid is not None and not SESSION_ID_RE.fullmatch(sid):
        return C.INVALID_ARGUMENT
    return None


def record(report, rpc, code, crashed):
    entry = report["fuzz"].setdefault(rpc, {"inputs": 0, "crashes": 0, "codes": {}})
    entry["inputs"] += 1
    entry["crashes"] += int(crashed)
    entry["codes"][code.name] = entry["codes"].get(code.name, 0) + 1


def call_survives(report, channel, rpc, call, what):
    """Run ``call``; its status code, recorded, after asserting the server answered with an allowed
    code and still serves (``what``: the input, for the message)."""
    try:
        call()
        code = C.OK
    except grpc.RpcError as e:
        code = e.code()
    crashed = code not in ALLOWED | {C.OK} or not serving(channel, timeout=30)
    record(report, rpc, code, crashed)
    assert not crashed, f"{rpc}: {code} for {what!r}"
    return code


def check(report, channel, rpc, call, request, md):
    code = call_survives(report, channel, rpc, call, request)
    want = expected_code(request, md)
    if want is not None:
        assert code == want, f"{rpc}: {code}, expected {want}, for {request!r}"


@FUZZ
@given(req=turn_requests(), md=metadata)
def test_fuzz_turn(fuzz_server, reliability_report, req, md):
    stub, channel = fuzz_server
    check(reliability_report, channel, "Turn", lambda: list(stub.Turn(req, metadata=md, timeout=120)), req, md)


@FUZZ
@given(req=chat_turns())
def test_fuzz_chat_content(fuzz_server, reliability_report, req):
    stub, channel = fuzz_server
    events: list = []
    check(
        reliability_report,
        channel,
        "Turn(chat content)",
        lambda: events.extend(stub.Turn(req, metadata=GOOD, timeout=120)),
        req,
        GOOD,
    )
    if events:  # a finished turn streams deltas / tool calls, then exactly one completion, last
        kinds = [e.WhichOneof("event") for e in events]
        assert kinds[-1] == "completion" and kinds.count("completion") == 1
        done = events[-1].completion
        assert 1 <= done.usage.generated_tokens <= req.max_tokens
        assert list(done.token_ids) == [t for e in events if e.HasField("delta") for t in e.delta.token_ids]


@pytest.mark.parametrize("rpc", sorted(UNARY))
def test_fuzz_unary(fuzz_server, reliability_report, rpc):
    stub, channel = fuzz_server

    @FUZZ
    @given(req=UNARY[rpc], md=metadata)
    def fuzz(req, md):
        check(reliability_report, channel, rpc, lambda: getattr(stub, rpc)(req, metadata=md, timeout=60), req, md)

    fuzz()


VALID = pb.TurnRequest(
    session_id="s1",
    request_id="r",
    max_tokens=2,
    temperature=0.5,
    seed=3,
    stop=["x"],
    messages=[pb.Message(role="user", content="Hello there")],
).SerializeToString()


@st.composite
def mutated(draw):
    """A valid TurnRequest's bytes with a few bytes replaced, cut or inserted."""
    data = bytearray(VALID)
    for _ in range(draw(st.integers(1, 4))):
        i = draw(st.integers(0, len(data) - 1))
        op = draw(st.sampled_from(["set", "cut", "insert"]))
        if op == "set":
            data[i] = draw(st.integers(0, 255))
        elif op == "cut":
            del data[i:]
            if not data:
                break
        else:
            data[i:i] = draw(st.binary(min_size=1, max_size=4))
    return bytes(data)


REQUEST_TYPES = {
    "Turn": pb.TurnRequest,
    "GetServerInfo": pb.GetServerInfoRequest,
    "Resume": pb.ResumeRequest,
    "GetSession": pb.GetSessionRequest,
    "EndSession": pb.EndSessionRequest,
    "ForkSession": pb.ForkSessionRequest,
    "PruneHistory": pb.PruneHistoryRequest,
}


def parsed(rpc: str, data: bytes):
    """``data`` as ``rpc``'s request message, or None when it is not one."""
    try:
        return REQUEST_TYPES[rpc].FromString(data)
    except DecodeError:
        return None


@FUZZ
@given(rpc=st.sampled_from(["Turn", *sorted(UNARY)]), data=st.one_of(st.binary(max_size=96), mutated()))
def test_fuzz_raw_bytes(fuzz_server, reliability_report, rpc, data):
    """Arbitrary bytes, and damaged valid requests, as the request message: bytes that do not parse
    as the request get INVALID_ARGUMENT; bytes that do are a request like any other (a bad session
    id in it gets INVALID_ARGUMENT too)."""
    _, channel = fuzz_server
    path = f"/chainkv.v1.Sidecar/{rpc}"
    if rpc == "Turn":
        call = lambda: list(  # noqa: E731
            channel.unary_stream(
                path,
                request_serializer=lambda b: b,
                response_deserializer=lambda b: b,
            )(data, metadata=GOOD, timeout=120)
        )
    else:
        call = lambda: channel.unary_unary(  # noqa: E731
            path,
            request_serializer=lambda b: b,
            response_deserializer=lambda b: b,
        )(data, metadata=GOOD, timeout=60)
    code = call_survives(reliability_report, channel, f"raw:{rpc}", call, data)
    request = parsed(rpc, data)
    want = C.INVALID_ARGUMENT if request is None else expected_code(request, GOOD)
    if want is not None:
        assert code == want, f"raw:{rpc}: {code}, expected {want}, for {data!r}"


def test_the_raw_bytes_check_sees_both_kinds_of_input():
    """The property above is only worth its name if the fuzzed inputs include bytes that do not
    parse, and bytes that do, for Turn."""
    assert parsed("Turn", VALID) is not None
    assert parsed("Turn", b"\xff\xff\xff") is None  # a truncated varint tag
    assert parsed("Turn", VALID.replace(b"Hello there", b"\xff\xfe\xfdlo there")) is None  # not UTF-8
