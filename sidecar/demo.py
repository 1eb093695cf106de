"""``chainkv demo``: a multi-turn, tool-using agent session against a running sidecar.

It plays a tiny agent: two local tools (a calculator and a clock) are offered on the first turn;
when the model answers with a tool call, the demo runs the tool and sends the result back as a
``tool`` message, and the model continues from its cached KV. Small models (SmolLM2-135M) often
answer directly instead of calling a tool; the demo says so and carries on. Each turn prints the
streamed text and its usage (new tokens, reused cache, tier, time to first token).

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

TOOLS = [
    pb.Tool(name="calculator", description="Evaluate an arithmetic expression, e.g. '12 * (3 + 4)'.",
            parameters_json=json.dumps({"type": "object", "properties": {"expression": {"type": "string"}},
                                        "required": ["expression"]})),
    pb.Tool(name="clock", description="The current local date and time.",
            parameters_json=json.dumps({"type": "object", "properties": {}})),
]
SYSTEM = ("You are a helpful assistant. When a tool helps, call it and wait for its result; "
          "otherwise answer briefly.")
QUESTIONS = ["What is 37 * 41? Use the calculator.", "What time is it now?",
             "Thanks! Sum up this conversation in one sentence."]

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow, ast.USub: operator.neg,
        ast.UAdd: operator.pos}


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
        return calculate(str(args.get("expression", "")))
    if name == "clock":
        return datetime.datetime.now().strftime("%A %d %B %Y, %H:%M:%S")
    return f"error: unknown tool {name!r}"


# where a turn found its session's KV, in words (TIER_GPU means the engine's device, a CPU included)
TIER_WORDS = {pb.TIER_NEW: "a new session", pb.TIER_GPU: "KV in device memory", pb.TIER_HOST: "KV in host memory",
              pb.TIER_STORE: "KV from the session store", pb.TIER_RECOMPUTE: "KV recomputed"}


def _usage_line(c: pb.TurnCompletion) -> str:
    u = c.usage
    return (f"[turn {c.turn_index}: {u.prompt_tokens} new tokens, {u.reused_tokens} reused from cache, "
            f"{u.prefilled_tokens} prefilled, {u.generated_tokens} generated, "
            f"ttft {u.time_to_first_token_s * 1000:.0f} ms, {TIER_WORDS.get(u.source_tier, 'tier unknown')}, "
            f"history {u.history_tokens} tokens, finish {pb.FinishReason.Name(c.finish_reason)[14:].lower()}]")


def turn(stub, metadata, session: str, messages: list[pb.Message], max_tokens: int, first: bool,
         out=sys.stdout) -> pb.TurnCompletion:
    req = pb.TurnRequest(session_id=session, request_id=uuid.uuid4().hex, messages=messages, max_tokens=max_tokens)
    if first:
        req.tools.extend(TOOLS)
    completion = None
    for event in stub.Turn(req, metadata=metadata):
        kind = event.WhichOneof("event")
        if kind == "delta":
            out.write(event.delta.text)
            out.flush()
        elif kind == "tool_call":
            out.write(f"\n  -> tool call: {event.tool_call.name}({event.tool_call.arguments_json})")
        else:
            completion = event.completion
    out.write("\n" + _usage_line(completion) + "\n")
    return completion


def run_demo(target: str, session: str | None = None, max_tokens: int = 96, token: str | None = None,
             tls_ca: str | None = None, out=sys.stdout) -> int:
    session = session or f"demo-{uuid.uuid4().hex[:8]}"
    metadata = [("authorization", f"Bearer {token}")] if token else None
    if tls_ca:
        channel = grpc.secure_channel(target, grpc.ssl_channel_credentials(open(tls_ca, "rb").read()))
    else:
        channel = grpc.insecure_channel(target)
    stub = sidecar_pb2_grpc.SidecarStub(channel)
    out.write(f"session {session} on {target}\n")
    tool_round_trips = 0
    try:
        for i, question in enumerate(QUESTIONS):
            out.write(f"\nuser: {question}\nassistant: ")
            msgs = ([pb.Message(role="system", content=SYSTEM)] if i == 0 else []) + [pb.Message(role="user", content=question)]
            c = turn(stub, metadata, session, msgs, max_tokens, first=i == 0, out=out)
            hops = 0
            while c.tool_calls and hops < 3:
                results = []
                for call in c.tool_calls:
                    result = run_tool(call.name, call.arguments_json)
                    out.write(f"  <- {call.name} returned: {result}\n")
                    results.append(pb.Message(role="tool", name=call.name, tool_call_id=call.id, content=result))
                tool_round_trips += 1
                hops += 1
                out.write("assistant: ")
                c = turn(stub, metadata, session, results, max_tokens, first=False, out=out)
            if i == 0 and tool_round_trips == 0:
                out.write("  (no tool call this time: the model answered directly; small models often do)\n")
        info = stub.GetSession(pb.GetSessionRequest(session_id=session), metadata=metadata)
        out.write(f"\nsession: {info.turn_index} turns, {info.history_tokens} history tokens, "
                  f"{info.kv_tokens} KV entries, snapshot {pb.SnapshotState.Name(info.snapshot_state)[15:].lower()}, "
                  f"{tool_round_trips} tool round trip(s)\n")
        stub.EndSession(pb.EndSessionRequest(session_id=session), metadata=metadata)
    except grpc.RpcError as e:
        out.write(f"\nchainkv demo: {e.code().name}: {e.details()}\n")
        return 1
    finally:
        channel.close()
    return 0
