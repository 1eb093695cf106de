"""Request fields both OpenAI APIs share, checked as hostile input and set on a ``TurnRequest``
(``sidecar.turns.request``: the typed turn both fronts hand the turn runner).

Sampling (temperature, top_p, presence/frequency/repetition penalties, seed, stop, the max tokens), function tools, ``tool_choice``, the JSON
output formats and the ``chainkv`` extension field (``extra_body={"chainkv": {"method": "snapkv",
"budget": 1024}}``: the session's method, checked by the same code as the gRPC Turn's), and Dynamo's
``nvext`` agent hints (``{"nvext": {"agent_hints": {"priority": 5, "expected_return_s": 4}, "session_control":
{"action": "pin", "ttl_seconds": 30}}}``). Anything
out of range is a 400 naming the field; nothing reaches the engine unchecked.
"""

from __future__ import annotations

import json
import math
from typing import Any

from engine.api import MAX_PRIORITY, MethodSpec
from sidecar.http.errors import OpenAIError, invalid
from sidecar.turns.request import AgentHints, SessionControl, Tool, TurnRequest
from sidecar.turns.structured import OutputSpecError, schema_text

INT32 = 2**31 - 1
INT64 = 2**63 - 1
MAX_STOP = 16
MAX_TOOLS = 128
MAX_SCHEMA_CHARS = 256 * 1024


def body_object(raw: bytes) -> dict[str, Any]:
    """The request body as a JSON object (400 for anything else)."""
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise invalid(f"the request body is not valid JSON ({type(e).__name__}: {str(e)[:200]})") from None
    if not isinstance(body, dict):
        raise invalid("the request body must be a JSON object")
    return body


def check_model(body: dict, served: str) -> str:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise invalid("model is required", "model")
    if model != served:
        raise OpenAIError(
            404,
            f"The model {model[:200]!r} does not exist; this server serves {served!r}",
            "invalid_request_error",
            "model",
            "model_not_found",
        )
    return model


def number(body: dict, name: str, lo: float, hi: float, *, lo_open: bool = False, prefix: str = "") -> float | None:
    v = body.get(name)
    if v is None:
        return None
    name = prefix + name
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise invalid(f"{name} must be a finite number", name)
    if v > hi or v < lo or (lo_open and v == lo):
        raise invalid(f"{name} must be in {'(' if lo_open else '['}{lo}, {hi}], not {v}", name)
    return float(v)


def integer(body: dict, name: str, lo: int, hi: int, *, prefix: str = "") -> int | None:
    v = body.get(name)
    if v is None:
        return None
    name = prefix + name
    if isinstance(v, bool) or not isinstance(v, int):
        raise invalid(f"{name} must be an integer", name)
    if not lo <= v <= hi:
        raise invalid(f"{name} must be between {lo} and {hi}, not {v}", name)
    return v


def set_sampling(req: TurnRequest, body: dict, max_token_names: tuple[str, ...]) -> None:
    """temperature, top_p, presence_penalty, frequency_penalty, repetition_penalty, top_k, seed, stop,
    ignore_eos and the first of ``max_token_names`` that is set."""
    t = number(body, "temperature", 0.0, 2.0)
    if t is not None:
        req.temperature = t
    p = number(body, "top_p", 0.0, 1.0, lo_open=True)
    if p is not None:
        req.top_p = p
    for name in ("presence_penalty", "frequency_penalty"):
        v = number(body, name, -2.0, 2.0)
        if v is not None:
            setattr(req, name, v)
    rp = number(body, "repetition_penalty", 0.01, 100.0)  # vLLM's extension; 1 is off
    if rp is not None:
        req.repetition_penalty = rp
    top_k = integer(body, "top_k", 0, INT32)  # vLLM's extension
    if top_k is not None:
        req.top_k = top_k
    seed = integer(body, "seed", -INT64 - 1, INT64)
    if seed is not None:
        req.seed = seed
    for name in max_token_names:
        n = integer(body, name, 1, INT32)
        if n is not None:
            req.max_tokens = n
            break
    ignore_eos = body.get("ignore_eos", False)  # vLLM's extension
    if not isinstance(ignore_eos, bool):
        raise invalid("ignore_eos must be a boolean", "ignore_eos")
    req.ignore_eos = ignore_eos
    stop = body.get("stop")
    if stop is not None:
        stops = [stop] if isinstance(stop, str) else stop
        if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
            raise invalid("stop must be a non-empty string or a list of them", "stop")
        if len(stops) > MAX_STOP:
            raise invalid(f"at most {MAX_STOP} stop strings", "stop")
        req.stop.extend(stops)


def set_extension(req: TurnRequest, body: dict) -> None:
    """The ``chainkv`` extension field: the session's sparse method (gRPC's method fields)."""
    ext = body.get("chainkv")
    if ext is None:
        return
    if not isinstance(ext, dict):
        raise invalid('chainkv must be an object like {"method": "snapkv", "budget": 1024}', "chainkv")
    unknown = set(ext) - set(MethodSpec.field_names())
    if unknown:
        raise invalid(f"unknown chainkv field(s): {', '.join(sorted(map(str, unknown)))}", "chainkv")
    method = ext.get("method", "")
    if not isinstance(method, str):
        raise invalid("chainkv.method must be a string", "chainkv.method")
    req.method = method
    budget = integer(ext, "budget", 1, INT32, prefix="chainkv.")
    if budget is not None:
        req.budget = budget
    ratio = number(ext, "budget_ratio", 0.0, 1.0, lo_open=True, prefix="chainkv.")
    if ratio is not None:
        req.budget_ratio = ratio
    args = ext.get("method_args") or {}
    if not isinstance(args, dict) or len(args) > 64:
        raise invalid("chainkv.method_args must be an object of at most 64 entries", "chainkv.method_args")
    for k, v in args.items():
        if isinstance(v, (dict, list)) or v is None:
            raise invalid("chainkv.method_args values must be strings or numbers", "chainkv.method_args")
        req.method_args[str(k)[:128]] = (json.dumps(v) if isinstance(v, bool) else str(v))[:1024]


AGENT_HINT_FIELDS = ("priority", "expected_return_s")
SESSION_CONTROL_FIELDS = ("action", "ttl_seconds")


def set_agent_hints(req: TurnRequest, body: dict) -> None:
    """Dynamo's ``nvext`` request extension: ``agent_hints`` (``priority``; ``expected_return_s``, this
    server's: when the agent expects its next turn) and ``session_control`` (``action`` "pin" with
    ``ttl_seconds``, or "release"), set on the Turn's AgentHints / SessionControl (whose checks, the
    same as gRPC's, follow)."""
    ext = body.get("nvext")
    if ext is None:
        return
    if not isinstance(ext, dict):
        raise invalid('nvext must be an object like {"agent_hints": {"priority": 5}}', "nvext")
    unknown = set(ext) - {"agent_hints", "session_control"}
    if unknown:
        raise invalid(
            f"unknown nvext field(s): {', '.join(sorted(map(str, unknown)))[:200]}; known: agent_hints, session_control",
            "nvext",
        )
    hints = _object(ext, "agent_hints", AGENT_HINT_FIELDS)
    if hints is not None:
        priority = integer(hints, "priority", -MAX_PRIORITY, MAX_PRIORITY, prefix="nvext.agent_hints.")
        back = number(hints, "expected_return_s", 0.0, 1e12, lo_open=True, prefix="nvext.agent_hints.")
        req.agent_hints = AgentHints(priority, back)
    control = _object(ext, "session_control", SESSION_CONTROL_FIELDS)
    if control is not None:
        action = control.get("action", "")
        if not isinstance(action, str):
            raise invalid("nvext.session_control.action must be a string", "nvext.session_control.action")
        req.session_control = SessionControl(action[:64])
        ttl = number(control, "ttl_seconds", 0.0, 1e12, lo_open=True, prefix="nvext.session_control.")
        req.session_control.ttl_seconds = ttl


def _object(ext: dict, name: str, known: tuple[str, ...]) -> dict | None:
    v = ext.get(name)
    if v is None:
        return None
    if not isinstance(v, dict):
        raise invalid(f"nvext.{name} must be an object", f"nvext.{name}")
    unknown = set(v) - set(known)
    if unknown:
        raise invalid(
            f"unknown nvext.{name} field(s): {', '.join(sorted(map(str, unknown)))[:200]}; known: {', '.join(known)}",
            f"nvext.{name}",
        )
    return v


def function_tool(name: Any, description: Any, parameters: Any, where: str) -> Tool:
    if not isinstance(name, str) or not name or len(name) > 128:
        raise invalid(f"{where}.name must be a non-empty string of at most 128 characters", where)
    if description is not None and not isinstance(description, str):
        raise invalid(f"{where}.description must be a string", where)
    if parameters is not None and not isinstance(parameters, dict):
        raise invalid(f"{where}.parameters must be a JSON Schema object", where)
    try:
        text = schema_text(parameters, "tools") if parameters else ""
    except OutputSpecError as e:
        raise invalid(f"{where}.parameters: {e}", "tools") from None
    if len(text) > MAX_SCHEMA_CHARS:
        raise invalid(f"{where}.parameters is too large", where)
    return Tool(name=name, description=description or "", parameters_json=text)


def set_tools(req: TurnRequest, tools: Any, nested: bool) -> None:
    """Function tools: Chat Completions nests them (``{"type": "function", "function": {...}}``), the
    Responses API does not (``{"type": "function", "name": ...}``)."""
    if tools is None:
        return
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise invalid(f"tools must be a list of at most {MAX_TOOLS} tools", "tools")
    for i, t in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(t, dict) or t.get("type") != "function":
            raise invalid(f"{where}: only function tools are supported", "tools")
        fn = t.get("function") if nested else t
        if not isinstance(fn, dict):
            raise invalid(f"{where}.function must be an object", "tools")
        req.tools.append(function_tool(fn.get("name"), fn.get("description"), fn.get("parameters"), where))


def set_tool_choice(req: TurnRequest, choice: Any, nested: bool) -> None:
    """ "none", "auto", "required", or a named function (``{"type": "function", "function": {"name"}}``
    in Chat Completions, ``{"type": "function", "name"}`` in the Responses API)."""
    if choice is None:
        return
    if isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            raise invalid("tool_choice must be none, auto, required or a function", "tool_choice")
        req.tool_choice.mode = choice
        return
    if isinstance(choice, dict) and choice.get("type") == "function":
        fn = choice.get("function") if nested else choice
        name = fn.get("name") if isinstance(fn, dict) else None
        if isinstance(name, str) and name:
            req.tool_choice.mode, req.tool_choice.function_name = "function", name
            return
    raise invalid('tool_choice must be none, auto, required or {"type": "function", ...} with a name', "tool_choice")


def set_format(req: TurnRequest, fmt: Any, param: str, nested: bool) -> None:
    """``text``, ``json_object`` or ``json_schema`` (its schema under ``json_schema.schema`` in Chat
    Completions, under ``schema`` in the Responses API's ``text.format``)."""
    if fmt is None:
        return
    if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema"):
        raise invalid(f"{param}.type must be text, json_object or json_schema", param)
    req.response_format.type = fmt["type"]
    if fmt["type"] == "json_schema":
        spec = fmt.get("json_schema") if nested else fmt
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, (dict, bool)):
            raise invalid(f"{param}: a json_schema format needs its schema (an object)", param)
        try:
            text = schema_text(schema)
        except OutputSpecError as e:
            raise invalid(f"{param}: {e}", param) from None
        if len(text) > MAX_SCHEMA_CHARS:
            raise invalid(f"{param}: the schema is too large", param)
        req.response_format.json_schema = text


def text_content(content: Any, where: str, part_types: tuple[str, ...] = ("text",)) -> str:
    """A message's content as text: a string, or a list of text parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        out = []
        for part in content:
            if (
                not isinstance(part, dict)
                or part.get("type") not in part_types
                or not isinstance(part.get("text"), str)
            ):
                raise invalid(f"{where}: only text content is supported", where)
            out.append(part["text"])
        return "".join(out)
    raise invalid(f"{where}.content must be a string or a list of text parts", where)


def arguments_object(arguments: Any, where: str) -> str:
    """Tool-call arguments (a JSON object, or its JSON text) as JSON text."""
    if isinstance(arguments, dict):
        return json.dumps(arguments)
    if isinstance(arguments, str):
        try:
            value = json.loads(arguments) if arguments.strip() else {}
        except (ValueError, RecursionError):
            raise invalid(f"{where}: arguments are not JSON", where) from None
        if isinstance(value, dict):
            return json.dumps(value)
    raise invalid(f"{where}: arguments must be a JSON object", where)
