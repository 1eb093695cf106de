"""The synthetic agent trace benchmarks/agent_trace.py replays: ``sessions`` agent runs of ``turns``
turns each. Every session starts with the same long system prompt (shared by all sessions, so the
prefix cache serves it) and its own task; every later turn sends one tool result of lognormal length
after an exponential think time (the agent running its tool). The trace is a function of its
:class:`TraceParams` alone (``trace_seed``), so every configuration replays the same messages."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

WORDS = (
    "data value result query table index record field status error output item list page user file time "
    "name type size count total range start end node path key text line code test run step time cache "
    "load save read write open close find match sort merge split join parse check build send fetch"
).split()
SYSTEM_HEAD = (
    "You are an autonomous research agent. Work step by step. Call one tool per turn and read its "
    "output carefully before the next step. Tools: search(query) returns web results; "
    "read(url) returns a page; python(code) runs code and returns stdout. "
)


@dataclass
class TraceParams:
    sessions: int = 2
    turns: int = 6
    system_words: int = 300
    task_words: int = 40
    tool_median: int = 250
    tool_sigma: float = 0.6
    tool_min: int = 16
    tool_max: int = 1200
    output_tokens: int = 8
    think_s: float = 0.1
    trace_seed: int = 0


def _words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def make_trace(p: TraceParams) -> tuple[list[list[list[dict]]], list[list[float]]]:
    """Per session, per turn: the new messages; and the think time before each turn."""
    rng = random.Random(p.trace_seed)
    system = SYSTEM_HEAD + _words(random.Random(-1), p.system_words)  # one prompt shared by every session
    sessions, thinks = [], []
    for s in range(p.sessions):
        turns = [
            [
                {"role": "system", "content": system},
                {"role": "user", "content": f"Task {s}: " + _words(rng, p.task_words)},
            ]
        ]
        think = [0.0]
        for _ in range(1, p.turns):
            n = int(min(p.tool_max, max(p.tool_min, rng.lognormvariate(math.log(p.tool_median), p.tool_sigma))))
            turns.append([{"role": "tool", "name": "search", "content": _words(rng, n)}])
            think.append(rng.expovariate(1 / p.think_s) if p.think_s > 0 else 0.0)
        sessions.append(turns)
        thinks.append(think)
    return sessions, thinks
