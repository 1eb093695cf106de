"""``chainkv demo``: a multi-turn, tool-using agent session against a running sidecar.

It plays a tiny agent: two local tools (a calculator and a clock) are offered on the first turn. A
question that needs a tool is sent with a forced tool choice, so the reply is one well-formed call
with valid arguments (grammar-constrained decoding: even SmolLM2-135M, which seldom calls a tool
on its own, does); the demo runs the tool, sends its result back as a ``tool`` message, and the
model answers in words from its cached KV. Each turn prints the streamed text and its usage (new
tokens, reused cache, tier, time to first token); the end sums up how much of the context came
from the cache instead of being prefilled again.

It uses the generated stubs only (sidecar._proto), as any gRPC client would.
"""

from __future__ import annotations

import ast
import datetime
import json
import operator
import sys
import uuid

import grpc

from sidecar._proto.chainkv.v1 import sidecar_pb2 as pb
from sidecar._proto.chainkv.v1 import sidecar_pb2_grpc
from sidecar.session_ids import SESSION_HEADER

TOOLS = [
    pb.Tool(
        name="calculator",
        description="Evaluate an arithmetic expression, e.g. '12 * (3 + 4)'.",
        parameters_json=json.dumps(
            {
                "type": "object",
                "additionalProperties": False,
                "required": ["expression"],
                "properties": {"expression": {"type": "string", "pattern": "^[0-9]{1,6}( ?[-+*/] ?[0-9]{1,6}){1,4}$"}},
            }
        ),
    ),
    pb.Tool(
        name="clock",
        description="The current local date and time.",
        parameters_json=json.dumps({"type": "object", "properties": {}, "additionalProperties": False}),
    ),
]
SYSTEM = "You are a helpful assistant. When a tool helps, call it and wait for its result; otherwise answer briefly."
# (question, the tool its turn must call or None): a forced call is decoded under a grammar, so even a
# small model makes a well-formed call with valid arguments; the turn after the tool's result is free
QUESTIONS = [
    ("What is 37 * 41?", "calculator"),
    ("What time is it now?", "clock"),
    ("Thanks! Sum up this conversation in one sentence.", None),
]
ANSWER_FORMAT = pb.ResponseFormat(type="regex", regex=r"[A-Z0-9][^<\n]{0,400}")
"""A turn that does not call a tool answers in one line of words (no tool markup as text)."""
FORCED_MAX_TOKENS = 96
"""Room for one tool call (its markup and arguments), whatever --max-tokens says."""

_OPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
    ast.USub: operator.neg,
    ast.UAdd: operator.pos,
}


def calculate(expression: str) -> str:
    """Arithmetic only (numbers and + - * / // % **), evaluated on the syntax tree: no eval()."""

    def ev(node):
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            if isinstance(node.op, ast.Pow) and abs(ev(node.right)) > 64:
                raise ValueError("exponent too large")
            return _OPS[type(node.op)](ev(node.left), ev(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.operand))
        raise ValueError("only arithmetic is supported")

    try:
        return str(ev(ast.parse(expression, mode="eval")))
    except (SyntaxError, ValueError, ZeroDivisionError, TypeError) as e:
        return f"error: {e}"


def run_tool(name: str, arguments_json: str) -> str:
    try:
        args = json.loads(arguments_json or "{}")
    except json.JSONDecodeError:
        args = {}
    if name == "calculator":
        expression = str(args.get("expression", ""))
        return f"{expression} = {calculate(expression)}. Tell the user the result in words."
    if name == "clock":
        return (
            "It is " + datetime.datetime.now().strftime("%A %d %B %Y, %H:%M:%S") + ". Tell the user the time in words."
        )
    return f"error: unknown tool {name!r}"


# where a turn found its session's KV, in words (TIER_GPU means the engine's device, a CPU included)
TIER_WORDS = {
    pb.TIER_NEW: "a new session",
    pb.TIER_GPU: "KV in device memory",
    pb.TIER_HOST: "KV in host memory",
    pb.TIER_STORE: "KV from the session store",
    pb.TIER_RECOMPUTE: "KV recomputed",
}


def _usage_line(c: pb.TurnCompletion) -> str:
    u = c.usage
    return (
        f"[turn {c.turn_index}: {u.prompt_tokens} new tokens, {u.reused_tokens} reused from cache, "
        f"{u.prefilled_tokens} prefilled, {u.generated_tokens} generated, "
        f"ttft {u.time_to_first_token_s * 1000:.0f} ms, {TIER_WORDS.get(u.source_tier, 'tier unknown')}, "
        f"history {u.history_tokens} tokens, finish {pb.FinishReason.Name(c.finish_reason)[14:].lower()}]"
    )


def turn(
    stub,
    metadata,
    session: str,
    messages: list[pb.Message],
    max_tokens: int,
    first: bool,
    force: str | None = None,
    out=sys.stdout,
) -> pb.TurnCompletion:
    """One streamed turn; ``force``: the tool it must call (else tool markup stays text: the demo's
    answers are words)."""
    req = pb.TurnRequest(
        session_id=session,
        request_id=uuid.uuid4().hex,
        messages=messages,
        max_tokens=max(max_tokens, FORCED_MAX_TOKENS) if force else max_tokens,
        tool_choice=pb.ToolChoice(mode="function", function_name=force) if force else pb.ToolChoice(mode="none"),
        response_format=None if force else ANSWER_FORMAT,
    )
    if first:
        req.tools.extend(TOOLS)
    completion = None
    for event in stub.Turn(req, metadata=metadata):
        kind = event.WhichOneof("event")
        if kind == "delta":
            out.write(event.delta.text)
            out.flush()
        elif kind == "tool_call":
            out.write(f"-> tool call: {event.tool_call.name}({event.tool_call.arguments_json})")
        else:
            completion = event.completion
    out.write("\n" + _usage_line(completion) + "\n")
    return completion


class _Reuse:
    """What the cache saved: context tokens taken from the session's KV vs prefilled, after turn 0."""

    def __init__(self):
        self.reused = self.prefilled = 0

    def add(self, c: pb.TurnCompletion) -> None:
        if c.turn_index > 0:
            self.reused += c.usage.reused_tokens
            self.prefilled += c.usage.prefilled_tokens

    def line(self) -> str:
        total = self.reused + self.prefilled
        share = 100.0 * self.reused / total if total else 0.0
        return (
            f"cache reuse: after the first turn, {self.reused} context tokens came from the session's KV and "
            f"only {self.prefilled} were prefilled ({share:.0f}% reused)"
        )


def run_demo(
    target: str,
    session: str | None = None,
    max_tokens: int = 96,
    token: str | None = None,
    tls_ca: str | None = None,
    out=sys.stdout,
) -> int:
    session = session or f"demo-{uuid.uuid4().hex[:8]}"
    # the session id travels as metadata too: a pool's proxy routes every call of it to one replica
    metadata = [(SESSION_HEADER, session)] + ([("authorization", f"Bearer {token}")] if token else [])
    if tls_ca:
        channel = grpc.secure_channel(target, grpc.ssl_channel_credentials(open(tls_ca, "rb").read()))
    else:
        channel = grpc.insecure_channel(target)
    stub = sidecar_pb2_grpc.SidecarStub(channel)
    out.write(f"session {session} on {target}\n")
    tool_round_trips, reuse = 0, _Reuse()
    try:
        for i, (question, tool) in enumerate(QUESTIONS):
            out.write(f"\nuser: {question}\nassistant: ")
            msgs = ([pb.Message(role="system", content=SYSTEM)] if i == 0 else []) + [
                pb.Message(role="user", content=question)
            ]
            c = turn(stub, metadata, session, msgs, max_tokens, first=i == 0, force=tool, out=out)
            reuse.add(c)
            if c.tool_calls:
                results = []
                for call in c.tool_calls:
                    result = run_tool(call.name, call.arguments_json)
                    out.write(f"  <- {call.name} returned: {result}\n")
                    results.append(pb.Message(role="tool", name=call.name, tool_call_id=call.id, content=result))
                tool_round_trips += 1
                out.write("assistant: ")
                reuse.add(turn(stub, metadata, session, results, max_tokens, first=False, out=out))
        info = stub.GetSession(pb.GetSessionRequest(session_id=session), metadata=metadata)
        out.write(
            f"\nsession: {info.turn_index} turns, {info.history_tokens} history tokens, "
            f"{info.kv_tokens} KV entries, snapshot {pb.SnapshotState.Name(info.snapshot_state)[15:].lower()}, "
            f"{tool_round_trips} tool round trip(s)\n{reuse.line()}\n"
        )
        stub.EndSession(pb.EndSessionRequest(session_id=session), metadata=metadata)
    except grpc.RpcError as e:
        out.write(f"\nchainkv demo: {e.code().name}: {e.details()}\n")
        return 1
    finally:
        channel.close()
    return 0
