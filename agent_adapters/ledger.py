"""Which messages of a conversation the sidecar's session has already seen.

Agent frameworks hand a chat model the whole conversation on every call; the sidecar wants only
the new messages (it keeps the rest as KV). The ledger remembers, per conversation key (a
LangGraph ``thread_id``, a LlamaIndex ``session_id``), the fingerprints of the messages the
session holds: those sent, plus the replies the session generated. A call whose messages extend
that record sends only the extension.

A call that does not extend it (the framework edited or rewound its history) or a key this
process has no record of while the sidecar already has a session under it (another process, a
restart) cannot be continued safely: the conversation moves to a fresh session id
``<key>~<random>`` that gets the whole history (correct, only without reuse for this once). A
session this process wrote and moved away from is ended once the fresh one has its first turn
(``Plan.replaces``); one another process wrote is left alone.

The conversation the framework holds is the truth; the session is a cache of it. The ledger also
remembers where each of the session's turns began, so a session that turns out to hold fewer
turns than recorded (a replica killed before its snapshot under ``--durability async``, a store
restored from older data: the sidecar refuses the turn and says how many it holds) is caught up
by ``recover``: one turn that re-sends every message after the turns it still holds, the lost
replies included as the framework has them.
Keys that are not valid session ids (1-128 characters of ``[A-Za-z0-9._:@+=~-]``) are hashed.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import threading
import uuid
from dataclasses import dataclass, field, replace
from typing import Sequence

from agent_adapters.messages import ChatMessage, TurnResult

log = logging.getLogger(__name__)

_VALID = re.compile(r"[A-Za-z0-9._:@+=~-]{1,110}")


def fingerprint(m: ChatMessage) -> str:
    calls = [[c.name, c.arguments] for c in m.tool_calls]
    return hashlib.sha256(json.dumps([m.role, m.content, calls], sort_keys=True).encode()).hexdigest()


def session_id_for(key: str) -> str:
    """A valid session id for a conversation key (the key itself when it is one)."""
    return key if _VALID.fullmatch(key) else "h-" + hashlib.sha256(key.encode()).hexdigest()[:40]


@dataclass
class Plan:
    key: str
    session_id: str
    messages: list[ChatMessage]
    """What to send: the messages the session has not seen."""
    first: bool
    """The session's first turn (send tools and method settings)."""
    known: bool
    """The ledger has a record for the session; False: check the sidecar does not already hold it."""
    fingerprints: list[str] = field(default_factory=list)
    expected_turn_index: int = 0
    """The session's turn index before this turn: the sidecar refuses the turn (FAILED_PRECONDITION)
    if the session is elsewhere (a turn lost to a crash, another writer), instead of silently
    giving this turn another index."""
    replaces: str = ""
    """The session this conversation moves away from (its history was edited): the adapter ends it
    once this turn has finished on the fresh session."""
    turn_starts: list[int] = field(default_factory=list)
    """How many of the conversation's messages the session held before each of its turns so far."""
    held: int = 0
    """How many of the conversation's messages the session holds before this turn (``messages`` follow them)."""


@dataclass
class _Entry:
    session_id: str
    seen: list[str]
    turns: int = 0
    turn_starts: list[int] = field(default_factory=list)


class SessionLedger:
    def __init__(self) -> None:
        self._entries: dict[str, _Entry] = {}
        self._lock = threading.Lock()

    def plan(self, key: str, messages: Sequence[ChatMessage]) -> Plan:
        if not messages:
            raise ValueError("a chat call needs at least one message")
        fps = [fingerprint(m) for m in messages]
        with self._lock:
            e = self._entries.get(key)
        if e is not None:
            n = len(e.seen)
            if fps[:n] == e.seen and len(fps) > n:
                return Plan(
                    key, e.session_id, list(messages[n:]), False, True, fps, e.turns, "", list(e.turn_starts), n
                )
            log.warning(
                "conversation %r does not extend what session %r holds; continuing on a fresh session",
                key,
                e.session_id,
            )
            return self._fresh(key, messages, fps, replaces=e.session_id)
        return Plan(key, session_id_for(key), list(messages), True, False, fps)

    def _fresh(self, key: str, messages: Sequence[ChatMessage], fps: list[str], replaces: str = "") -> Plan:
        base = session_id_for(key)
        return Plan(key, f"{base}~{uuid.uuid4().hex[:12]}", list(messages), True, True, fps, replaces=replaces)

    def rotate(self, plan: Plan) -> Plan:
        """The sidecar already holds ``plan.session_id`` with a history this process did not write."""
        log.warning(
            "session %r exists on the sidecar with a history this client did not record; "
            "continuing conversation %r on a fresh session",
            plan.session_id,
            plan.key,
        )
        return self._fresh(plan.key, plan.messages, plan.fingerprints)

    def recover(self, plan: Plan, messages: Sequence[ChatMessage], held_turns: int) -> Plan | None:
        """``plan`` was refused: its session holds only ``held_turns`` turns, fewer than the plan expected
        (turns were lost). The plan that catches it up: every message of ``messages`` (the whole
        conversation the plan was made from) after those turns, at index ``held_turns``. None when the
        session is not behind the plan (nothing to re-send)."""
        if not 0 <= held_turns < plan.expected_turn_index or held_turns > len(plan.turn_starts):
            return None
        held = plan.turn_starts[held_turns] if held_turns < len(plan.turn_starts) else plan.held
        log.warning(
            "session %r holds %d turns, not %d: re-sending the %d messages after them",
            plan.session_id,
            held_turns,
            plan.expected_turn_index,
            len(messages) - held,
        )
        return replace(
            plan,
            messages=list(messages[held:]),
            first=held_turns == 0,
            expected_turn_index=held_turns,
            turn_starts=plan.turn_starts[:held_turns],
            held=held,
        )

    def record(self, plan: Plan, result: TurnResult) -> None:
        """The turn finished: the session now holds the messages and its reply."""
        reply = ChatMessage("assistant", result.text, tool_calls=result.tool_calls)
        with self._lock:
            self._entries[plan.key] = _Entry(
                plan.session_id,
                plan.fingerprints + [fingerprint(reply)],
                result.turn_index + 1,
                plan.turn_starts + [plan.held],
            )

    def session_of(self, key: str) -> str | None:
        with self._lock:
            e = self._entries.get(key)
        return e.session_id if e else None

    def forget(self, key: str) -> None:
        with self._lock:
            self._entries.pop(key, None)


__all__ = ["Plan", "SessionLedger", "fingerprint", "session_id_for"]
