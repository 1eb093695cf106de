"""Realistic agent transcripts for the fidelity benchmark (benchmarks/agent_fidelity.py), from a seed.

A transcript is a tool-using agent session in SmolLM2's chat format (ChatML): a system prompt and a
user task, then ``steps`` turns in which the assistant calls a tool (a fixed ``<tool_call>`` JSON,
part of the turn's input) and the tool answers, then ``questions`` user turns that each ask about one
earlier tool output. Every turn ends with the generation prompt, so the model writes a reply after
it (short after a tool output, longer after a question); the harness runs dense first and its
replies become part of the transcript every other configuration is measured on.

Tool outputs are built from text the repository ships:

``code``    a slice of one of the repo's own ``.py`` files (``read_file``); asked: the first function
            the slice defines
``json``    the head of a ``benchmarks/results/*.json`` file with a ``run_id`` field added
            (``head -n``); asked: the run_id
``log``     timestamped log lines whose messages are lines of ``benchmarks/results/logs/*.txt``, one of
            them the server's listen line with a random port (``tail -n``); asked: the port
``search``  paragraphs of ``docs/*.md`` as ranked search results (``search_docs``); asked: the path of
            the top result

Each question names the step and the call, so only that tool output answers it, and asks for the
value first and a short explanation after it (the reply the agreement measure reads). The sizes of
the tool outputs are set from a token counter (``count``) so the whole session, replies included,
comes near ``tokens``.
"""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
KINDS = ("code", "json", "log", "search")
SYSTEM = (
    "You are a coding agent working in the chainkv repository, an LLM inference sidecar. You call tools "
    "with <tool_call> JSON and read their results. Keep track of what each tool returned: the user "
    "will ask about earlier results."
)
TASK = (
    "Look around the repository: read some code, check a benchmark result, the server log and the docs. "
    "I will ask you about what you found."
)
QUESTION = {
    "code": "In {path}, which you read in step {step}, what is the name of the first function defined? "
    "Give the name first, then say in one sentence what the function does.",
    "json": "What was the run_id in the JSON you printed from {path} in step {step}? Give the number "
    "first, then summarize that result in one sentence.",
    "log": "Which port did the server listen on in the log you read in step {step}? Give the port number "
    "first, then describe the log in one sentence.",
    "search": "Which document was the top search result for '{query}' in step {step}? Give its path "
    "first, then say in one sentence what it covers.",
}
OVERHEAD_TOKENS = {"head": 110, "step": 60, "question": 70}
"""Rough token counts of the fixed text around tool outputs (for sizing them)."""


@dataclass
class Turn:
    text: str
    """The turn's input: ChatML messages ending with the generation prompt."""
    reply_tokens: int
    """Tokens dense may generate after it."""
    answer: str | None = None
    """The expected answer of a question turn (exact match: it appears in the reply)."""
    kind: str = ""
    """The tool output kind a question turn asks about (or the step's own kind)."""
    step: int | None = None
    """The step a question asks about (``None`` on tool turns)."""


@dataclass
class Transcript:
    seed: int
    turns: list[Turn] = field(default_factory=list)

    @property
    def questions(self) -> list[int]:
        return [i for i, t in enumerate(self.turns) if t.answer is not None]


def _sources() -> dict[str, list[Path]]:
    py = sorted(p for d in ("engine", "sidecar", "benchmarks") for p in (ROOT / d).rglob("*.py") if p.stat().st_size)
    return {
        "code": [p for p in py if len(re.findall(r"^\s*def \w+", p.read_text(), re.M)) >= 2],
        "json": sorted((ROOT / "benchmarks" / "results").glob("*.json")),
        "log": sorted((ROOT / "benchmarks" / "results" / "logs").glob("*.txt")),
        "search": sorted(p for p in (ROOT / "docs").glob("*.md") if p.name != "benchmarks.md"),
    }


def _fill(units: list[str], target: int, count: Callable[[str], int]) -> list[str]:
    """The leading units whose token count reaches ``target`` (at least one)."""
    out, n = [], 0
    for u in units:
        if out and n >= target:
            break
        out.append(u)
        n += count(u)
    return out


def _code(rng, src, target, count) -> tuple[dict, str, str, dict]:
    path = rng.choice(src["code"])
    lines = path.read_text().splitlines()
    defs = [i for i, s in enumerate(lines) if re.match(r"\s*def \w+", s)]
    first = rng.choice(defs[: max(1, len(defs) - 1)])
    start = max(0, first - rng.randint(0, 6))
    if any(re.match(r"\s*def \w+", s) for s in lines[start:first]):
        start = first
    body = _fill([s + "\n" for s in lines[start:]], target, count)
    rel = path.relative_to(ROOT).as_posix()
    name = re.match(r"\s*def (\w+)", lines[first]).group(1)
    call = {"name": "read_file", "arguments": {"path": rel, "start_line": start + 1, "end_line": start + len(body)}}
    return call, "".join(body), name, {"path": rel}


def _json(rng, src, target, count) -> tuple[dict, str, str, dict]:
    path = rng.choice(src["json"])
    run_id = str(rng.randint(100000, 999999))
    data = json.loads(path.read_text())
    obj = {"run_id": int(run_id), **data} if isinstance(data, dict) else {"run_id": int(run_id), "rows": data}
    lines = [s + "\n" for s in json.dumps(obj, indent=1).splitlines()]
    body = _fill(lines, target, count)
    rel = path.relative_to(ROOT).as_posix()
    call = {"name": "run_command", "arguments": {"cmd": f"head -n {len(body)} {rel}"}}
    return call, "".join(body), run_id, {"path": rel}


def _log(rng, src, target, count) -> tuple[dict, str, str, dict]:
    messages = [s.strip()[:200] for p in src["log"] for s in p.read_text().splitlines() if s.strip()]
    port = str(rng.randint(20000, 65000))
    modules = ("engine", "sidecar", "scheduler", "chain", "http")
    t = rng.randint(0, 20000)
    units = []
    for _ in range(4000):
        t += rng.randint(1, 900)
        level = rng.choice(("INFO", "INFO", "INFO", "DEBUG", "WARNING"))
        units.append(
            f"{t // 3600000 % 24:02d}:{t // 60000 % 60:02d}:{t // 1000 % 60:02d}.{t % 1000:03d} {level} "
            f"chainkv.{rng.choice(modules)}: {rng.choice(messages)}\n"
        )
    body = _fill(units, target, count)
    at = rng.randrange(len(body))
    stamp = body[at].split(" ")[0]
    body.insert(at, f"{stamp} INFO chainkv.sidecar: serving gRPC on 0.0.0.0:{port}\n")
    call = {"name": "run_command", "arguments": {"cmd": f"tail -n {len(body)} /var/log/chainkv/sidecar.log"}}
    return call, "".join(body), port, {}


def _search(rng, src, target, count) -> tuple[dict, str, str, dict]:
    paras = []
    for p in src["search"]:
        heading = p.stem
        for block in p.read_text().split("\n\n"):
            block = block.strip()
            if block.startswith("#"):
                heading = block.lstrip("#").strip().splitlines()[0]
            elif len(block) > 200 and not block.startswith(("|", "```")):
                paras.append((p.relative_to(ROOT).as_posix(), heading, block[:900]))
    picked = rng.sample(paras, min(len(paras), 40))
    query = " ".join(picked[0][1].split()[:6])
    units = [
        f"{i + 1}. {path} - {heading} (score {0.95 - 0.04 * i:.2f})\n{text}\n\n"
        for i, (path, heading, text) in enumerate(picked)
    ]
    body = _fill(units, target, count)
    call = {"name": "search_docs", "arguments": {"query": query, "top_k": len(body)}}
    return call, "".join(body), Path(picked[0][0]).name, {"query": query}


BUILDERS = {"code": _code, "json": _json, "log": _log, "search": _search}


def make_transcript(
    seed: int,
    tokens: int,
    count: Callable[[str], int],
    steps: int = 6,
    questions: int = 3,
    step_reply: int = 8,
    answer_reply: int = 48,
) -> Transcript:
    """One transcript of about ``tokens`` tokens (``count``: text -> tokens): ``steps`` tool turns,
    then ``questions`` question turns about distinct earlier steps, the oldest asked first."""
    if not 1 <= questions <= steps:
        raise ValueError(f"questions must be in [1, steps], not {questions}")
    rng = random.Random(seed)
    src = _sources()
    kinds = [KINDS[i % len(KINDS)] for i in range(steps)]
    rng.shuffle(kinds)
    fixed = OVERHEAD_TOKENS["head"] + steps * (OVERHEAD_TOKENS["step"] + step_reply)
    fixed += questions * (OVERHEAD_TOKENS["question"] + answer_reply)
    per_output = max(32, (tokens - fixed) // steps)
    tr = Transcript(seed)
    facts = []
    for k, kind in enumerate(kinds, start=1):
        call, output, answer, about = BUILDERS[kind](rng, src, per_output, count)
        call = {"step": k, **call}
        text = (
            f"<|im_start|>assistant\n<tool_call>\n{json.dumps(call)}\n</tool_call><|im_end|>\n"
            f"<|im_start|>tool\n{output}<|im_end|>\n<|im_start|>assistant\n"
        )
        if k == 1:
            text = f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n{TASK}<|im_end|>\n" + text
        tr.turns.append(Turn(text, step_reply, kind=kind))
        facts.append((k, kind, answer, about))
    asked = sorted(rng.sample(facts[:-1] if len(facts) > questions else facts, questions))
    for k, kind, answer, about in asked:
        q = QUESTION[kind].format(step=k, **about)
        text = f"<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n"
        tr.turns.append(Turn(text, answer_reply, answer=answer, kind=kind, step=k))
    return tr


def is_correct(reply: str, answer: str) -> bool:
    """Exact match: the answer appears in the reply as a whole token (not inside a longer word/number)."""
    return re.search(rf"(?<![\w.]){re.escape(answer)}(?![\w])", reply) is not None
