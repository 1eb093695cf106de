"""``response_format`` and ``tool_choice`` as the adapters take them, turned into the Turn's fields.

Both follow the OpenAI shapes, so a value written for an OpenAI client works here too:

- ``response_format``: ``"text"``, ``"json_object"``, ``{"type": "json_object"}``,
  ``{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}`` (the schema may also be
  given directly, as a dict or as JSON text), ``{"type": "regex", "regex": ...}``,
  ``{"type": "grammar", "grammar": ...}``, or a ``ResponseFormat`` message.
- ``tool_choice``: ``"auto"``, ``"none"``, ``"required"`` (also LangChain's ``"any"`` and ``True``),
  ``{"type": "function", "function": {"name": ...}}`` (exactly one call to that tool), or a
  ``ToolChoice`` message. A bare tool name is the adapters' business (they know the tool names).

The server checks the rest (a schema it cannot compile, a function that is not one of the
session's tools) and answers INVALID_ARGUMENT.
"""

from __future__ import annotations

import json
from typing import Any, Mapping

from sidecar._proto.chainkv.v1 import sidecar_pb2 as pb

OUTPUT_FIELDS = ("response_format", "tool_choice")
_MODES = {"auto": "auto", "none": "none", "required": "required", "any": "required"}


def response_format_proto(value: Any) -> pb.ResponseFormat:
    if isinstance(value, pb.ResponseFormat):
        return value
    if isinstance(value, str):
        return pb.ResponseFormat(type=value)
    if not isinstance(value, Mapping):
        raise TypeError(f"response_format must be a string, a dict or a ResponseFormat, not {type(value).__name__}")
    kind = value.get("type") or "text"
    if kind == "json_schema":
        spec = value.get("json_schema")
        if spec is None:
            raise ValueError("response_format json_schema needs its schema ({'json_schema': {'schema': {...}}})")
        if isinstance(spec, Mapping) and isinstance(spec.get("schema"), (Mapping, str)):
            spec = spec["schema"]  # the OpenAI envelope {"name", "schema", "strict"}
        schema = spec if isinstance(spec, str) else json.dumps(spec)
        return pb.ResponseFormat(type="json_schema", json_schema=schema)
    return pb.ResponseFormat(type=kind, regex=str(value.get("regex") or ""), grammar=str(value.get("grammar") or ""))


def tool_choice_proto(value: Any) -> pb.ToolChoice:
    if isinstance(value, pb.ToolChoice):
        return value
    if value is True:
        return pb.ToolChoice(mode="required")
    if value is False:
        return pb.ToolChoice(mode="none")
    if isinstance(value, str):
        if value not in _MODES:
            raise ValueError(
                f"tool_choice must be one of {sorted(_MODES)} or {{'type': 'function', 'function': "
                f"{{'name': ...}}}}, not {value!r}"
            )
        return pb.ToolChoice(mode=_MODES[value])
    if isinstance(value, Mapping):
        fn = value.get("function") if value.get("type", "function") == "function" else None
        name = (fn or {}).get("name") if isinstance(fn, Mapping) else value.get("name")
        if isinstance(name, str) and name:
            return pb.ToolChoice(mode="function", function_name=name)
    raise ValueError(f"tool_choice {value!r} is not a mode or {{'type': 'function', 'function': {{'name': ...}}}}")


def named_tool_choice(value: Any, tool_names: list[str]) -> Any:
    """An adapter's ``tool_choice``: a bare string that names one of ``tool_names`` (and is not a
    mode) becomes the OpenAI ``{"type": "function", ...}`` form; anything else is kept as it is."""
    if isinstance(value, str) and value not in _MODES and value in tool_names:
        return {"type": "function", "function": {"name": value}}
    if isinstance(value, str) and value not in _MODES:
        raise ValueError(
            f"tool_choice {value!r} is neither a mode ({', '.join(sorted(_MODES))}) nor one of the "
            f"bound tools ({', '.join(tool_names) or 'none'})"
        )
    return value


__all__ = ["OUTPUT_FIELDS", "named_tool_choice", "response_format_proto", "tool_choice_proto"]
