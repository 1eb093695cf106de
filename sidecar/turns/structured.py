"""Structured output and tool choice, as the gRPC Turn and the HTTP front take them, turned into the
engine's grammar constraint (engine/constrained.py).

- ``response_format``: ``text`` (free), ``json_object``, ``json_schema`` (the reply validates against
  the schema), ``regex``, ``grammar`` (EBNF).
- ``tool_choice``: ``auto`` (the model decides; tool markup in the reply is parsed into calls),
  ``none`` (the markup stays text), ``required`` (exactly one call to one of the session's tools)
  or ``function`` (exactly one call to the named tool). A forced call is one Hermes call,
  ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``, whose arguments validate against
  the tool's parameter schema: what ``sidecar.turns.tool_calls`` parses back, and what both the templates
  that take tools (Qwen2.5) and the Hermes system prompt written for those that do not (SmolLM2)
  ask the model for.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from engine.api import Constraint, ConstraintError
from sidecar.turns.chat import ToolSpec
from sidecar.turns.tool_calls import CLOSE, OPEN

FORMATS = ("text", "json_object", "json_schema", "regex", "grammar")
TOOL_CHOICES = ("auto", "none", "required", "function")


class OutputSpecError(ValueError):
    """A response_format or tool_choice that cannot be honoured (INVALID_ARGUMENT). ``field``: the
    request field at fault, by its gRPC name (``response_format``, ``tool_choice`` or ``tools``); a
    front names it as its own API does (the Responses API's ``text.format``)."""

    def __init__(self, message: str, field: str = "response_format"):
        super().__init__(message)
        self.field = field


@dataclass
class OutputSpec:
    format: str = "text"
    json_schema: str = ""
    regex: str = ""
    grammar: str = ""
    tool_choice: str = "auto"
    function_name: str = ""

    def __post_init__(self) -> None:
        self.format = self.format or "text"
        self.tool_choice = self.tool_choice or "auto"
        if self.format not in FORMATS:
            raise OutputSpecError(f"response_format type must be one of {', '.join(FORMATS)}, not {self.format!r}")
        if self.tool_choice not in TOOL_CHOICES:
            raise OutputSpecError(
                f"tool_choice must be one of {', '.join(TOOL_CHOICES)}, not {self.tool_choice!r}", "tool_choice"
            )
        if self.tool_choice == "function" and not self.function_name:
            raise OutputSpecError("tool_choice function needs the function's name", "tool_choice")
        if self.tool_choice != "function" and self.function_name:
            raise OutputSpecError("a function name goes with tool_choice function only", "tool_choice")

    @property
    def forces_tool(self) -> bool:
        return self.tool_choice in ("required", "function")

    @property
    def constraint_field(self) -> str:
        """The request field whose grammar the reply follows: a forced call's comes from the tools'
        parameter schemas, any other from ``response_format``."""
        return "tools" if self.forces_tool else "response_format"

    @property
    def parses_tools(self) -> bool:
        """Tool-call markup in the reply becomes tool calls (every choice but ``none``)."""
        return self.tool_choice != "none"

    def constraint(self, tools: list[ToolSpec]) -> Constraint | None:
        """The grammar the reply must follow, or None for free text. ``tools``: the session's."""
        try:
            if self.forces_tool:
                return tool_call_constraint(tools, self.function_name or None)
            if self.format == "json_object":
                return Constraint("json_object")
            if self.format == "json_schema":
                if not self.json_schema:
                    raise OutputSpecError("response_format json_schema needs its schema")
                return Constraint("json_schema", self.json_schema)
            if self.format == "regex":
                return Constraint("regex", self.regex)
            if self.format == "grammar":
                return Constraint("grammar", self.grammar)
        except ConstraintError as e:
            raise OutputSpecError(str(e), self.constraint_field) from None
        return None


def tool_call_constraint(tools: list[ToolSpec], name: str | None = None) -> Constraint:
    """One Hermes tool call to ``name`` (or to any of ``tools``), its arguments valid for the tool."""
    if not tools:
        raise OutputSpecError("a forced tool call needs the session's tools (send them with the turn)", "tools")
    chosen = [t for t in tools if name is None or t.name == name]
    if not chosen:
        raise OutputSpecError(
            f"tool_choice names {name!r}, which is not one of the tools ({', '.join(t.name for t in tools)})",
            "tool_choice",
        )
    options = [
        {
            "type": "object",
            "properties": {"name": {"const": t.name}, "arguments": _arguments_schema(t)},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for t in chosen
    ]
    schema = options[0] if len(options) == 1 else {"anyOf": options}
    return Constraint.json_schema(schema, prefix=OPEN + "\n", suffix="\n" + CLOSE)


def _arguments_schema(tool: ToolSpec) -> dict:
    params = dict(tool.parameters or {})
    if not params:
        return {"type": "object", "properties": {}, "additionalProperties": False}
    params.setdefault("type", "object")
    if params.get("type") != "object":
        raise OutputSpecError(f"tool {tool.name!r}: its parameters must be an object schema to force a call", "tools")
    return params


def tools_from_meta(entries: list) -> list[ToolSpec]:
    """The session's tools as kept in its app metadata (``ToolSpec.openai`` dicts)."""
    out = []
    for e in entries or []:
        fn = e.get("function", {}) if isinstance(e, dict) else {}
        if fn.get("name"):
            out.append(ToolSpec(fn["name"], fn.get("description", ""), fn.get("parameters") or {}))
    return out


def schema_text(schema, field: str = "response_format") -> str:
    """A JSON Schema given as an object (HTTP) as canonical JSON text; ``field``: the request field it
    came from."""
    if isinstance(schema, str):
        return schema
    try:
        return json.dumps(schema, separators=(",", ":"))  # key order kept: properties are written in it
    except (TypeError, ValueError, RecursionError) as e:
        raise OutputSpecError(f"the JSON schema cannot be serialized: {e}", field) from None
