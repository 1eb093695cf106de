"""Tool calls in streamed model output: ``<tool_call>{json}</tool_call>`` (the Hermes / Qwen convention).

``ToolCallParser.feed`` takes text deltas as they stream and returns events: plain text (with the
markup held back while it might still be the start of a tag) and complete tool calls. A call is
``{"name": str, "arguments": object}`` (``"parameters"`` is accepted for ``"arguments"``, and
arguments given as a JSON string are parsed). Markup that does not hold a well-formed call is
passed through as text (at the end of the reply), so a small model's near-misses stay visible
instead of vanishing; a closing tag inside the arguments' strings does not end the call. At the
end of a reply, an unclosed ``<tool_call>`` whose body is a complete call (the model stopped
before the closing tag) still counts.

Only the tools the turn declared can be called: a well-formed call to any other name (a function the
model made up, or one a user message talked it into writing) stays text, so it never reaches an
agent as a call to execute. (Under ``tool_choice`` required or a named function the grammar allows
declared names only; under ``auto`` this parser is what keeps them out.)
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Iterable

from sidecar.turns.validation import loads_bounded

OPEN, CLOSE = "<tool_call>", "</tool_call>"


@dataclass(frozen=True)
class ParsedToolCall:
    name: str
    arguments_json: str
    """The arguments as a compact JSON object."""


def parse_call(body: str) -> ParsedToolCall | None:
    """A tool call from the JSON between the tags, or None if it is not one."""
    try:
        obj = loads_bounded(body)
    except (json.JSONDecodeError, ValueError):
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = loads_bounded(args) if args.strip() else {}
        except ValueError:  # not JSON, or nested too deep
            return None
    if not isinstance(args, dict):
        return None
    return ParsedToolCall(obj["name"], json.dumps(args, separators=(",", ":"), ensure_ascii=False))


class ToolCallParser:
    """Splits streamed text into ``("text", str)`` and ``("tool_call", ParsedToolCall)`` events.
    ``declared``: the names of the tools the turn may call; a call to any other name is text."""

    def __init__(self, declared: Iterable[str]) -> None:
        self.declared = frozenset(declared)
        self._buf = ""
        self._inside = False

    def _call(self, events: list, body: str, closed: bool) -> bool:
        """The event of the markup around ``body``: a call to a declared tool, or its text. False when
        ``body`` does not hold a call at all."""
        call = parse_call(body)
        if call is None:
            return False
        if call.name in self.declared:
            events.append(("tool_call", call))
        else:
            _text(events, OPEN + body + (CLOSE if closed else ""))
        return True

    def feed(self, text: str) -> list[tuple[str, object]]:
        self._buf += text
        events: list[tuple[str, object]] = []
        while True:
            if not self._inside:
                at = self._buf.find(OPEN)
                if at < 0:
                    keep = _partial_suffix(self._buf, OPEN)
                    _text(events, self._buf[: len(self._buf) - keep])
                    self._buf = self._buf[len(self._buf) - keep :]
                    return events
                _text(events, self._buf[:at])
                self._buf = self._buf[at + len(OPEN) :]
                self._inside = True
            else:
                at = _closing(self._buf)
                if at < 0:  # no closing tag yet, or none after which the body parses: wait for more
                    return events
                self._call(events, self._buf[:at], closed=True)
                self._buf = self._buf[at + len(CLOSE) :]
                self._inside = False

    def finish(self) -> list[tuple[str, object]]:
        """The events still held back when the reply ends."""
        events: list[tuple[str, object]] = []
        if self._inside:
            at = _closing(self._buf)
            if not self._call(events, self._buf[:at] if at >= 0 else self._buf, closed=at >= 0):
                _text(events, OPEN + self._buf)
            elif at >= 0:
                _text(events, self._buf[at + len(CLOSE) :])
        else:
            _text(events, self._buf)
        self._buf, self._inside = "", False
        return events


def _closing(buf: str) -> int:
    """Where the closing tag of the call in ``buf`` is: the first one after which the body parses
    (a tag inside the arguments' strings is skipped); -1 when there is none yet."""
    at = buf.find(CLOSE)
    while at >= 0:
        if parse_call(buf[:at]) is not None:
            return at
        at = buf.find(CLOSE, at + len(CLOSE))
    return -1


def _text(events: list, text: str) -> None:
    if text:
        if events and events[-1][0] == "text":
            events[-1] = ("text", events[-1][1] + text)
        else:
            events.append(("text", text))


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class PlainText:
    """``ToolCallParser``'s interface for a reply whose tool markup stays text (tool_choice none)."""

    def feed(self, text: str) -> list[tuple[str, object]]:
        return [("text", text)] if text else []

    def finish(self) -> list[tuple[str, object]]:
        return []
