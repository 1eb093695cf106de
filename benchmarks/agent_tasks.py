"""Task families of the agent-quality harness (benchmarks/agent_quality.py), generated from a seed.

Every sample is a multi-turn agent session in SmolLM2's chat format (ChatML). A turn is the new
text the agent sends: tool output in a ``tool`` message (the role Prefix-Cache Pruning acts on),
the assistant's fixed acknowledgement, and, on a question turn, a user question followed by the
generation prompt and the start of the assistant's reply (the record's key and colon), so the model
generates the value itself. Turns without a question end with the acknowledgement and generate
one token, its ``<|im_end|>`` (the engine always samples at least one). Answers are scored by
exact match.

The records are short ``key: value`` lines (an adjective_noun key, a 4-digit value): the format
a 135M model retrieves reliably, so that a loss shows as a loss. Families:

``needle``   turn 1's tool output holds the record asked about among filler records; turns
             2..N-1 add tool outputs of filler records; turn N adds one more and asks for the
             record's value. Distance = N - 1 turns.
``state``    a key's value is set in turn 1's tool output and updated by later tool outputs
             (each holds one update among filler records), the last update ``lag`` turns before
             the question (turn N). Asks for the key's latest value. Distance = ``lag``.
``shared``   turn 1 is one long tool output (a file the agent read: sections of records); each
             later turn asks about a different section (SCBench-style shared context).
             Distance of question q = q turns.

Sizes (``Size``) name the turns and records per tool output; the harness's calibration keeps the
sizes where dense, re-prefilled every turn, answers well enough.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

ADJ = (
    "amber azure bold brave bright calm clever cold crimson dark eager early fair fast fierce gentle golden "
    "grand green happy hidden humble icy jolly keen kind late lazy little lively loud lucky mellow mighty "
    "misty noble odd pale plain polite proud quick quiet rapid rare red rich round royal rusty shy silent "
    "silver simple sleepy slow smooth soft solid sour spare steady stern stony sunny swift tall tame tidy "
    "tiny vast warm wild wise young"
).split()
NOUN = (
    "anchor apple arrow badger basket beacon bell birch bottle bridge brook candle canyon castle cedar "
    "cherry cloud comet copper coral crane crystal dagger desert dragon eagle ember falcon feather fern "
    "forest fox garden glacier harbor hawk island jaguar kettle lantern lemon lily maple marble meadow "
    "mirror moon nebula oak ocean orchid otter owl panda pebble pepper pine planet pond raven river "
    "robin rocket saddle sparrow spruce star stone storm tiger tower tulip valley violet walnut whale "
    "willow wolf"
).split()

SYSTEM = (
    "You are a helpful agent. You call tools and read their results. Tool results are lists of "
    "records, one per line, written as key: value."
)
TASK = {
    "needle": "Look up the records I need with the tools, then answer my question.",
    "state": "Track the value of key {key} as the tools update it, then answer my question.",
    "shared": "Read the file with the tool, then answer my questions about it.",
}
ACK = "Noted."
QUESTION = {
    "needle": "What is the value of key {key}? Answer with the value only.",
    "state": "What is the latest value of key {key}? Answer with the value only.",
    "shared": "What is the value of key {key}? Answer with the value only.",
}
ANSWER_LEAD = {"needle": "{key}:", "state": "{key}:", "shared": "{key}:"}
"""The assistant's reply starts with this (given, not generated): the record's own prefix, so the
model generates the value as a copy (a 135M model answering in its own words names a neighbour's
value: "The value of key X is" was answered with the value on the line before X's)."""
FAMILIES = tuple(QUESTION)


@dataclass(frozen=True)
class Size:
    """One size of a family: ``turns`` (N), ``records`` per tool output (``shared``: records in
    the file), ``lag`` (``state``: turns between the last update and the question)."""

    turns: int
    records: int
    lag: int = 0

    @property
    def label(self) -> str:
        extra = f"-lag{self.lag}" if self.lag else ""
        return f"N{self.turns}-r{self.records}{extra}"


@dataclass
class Piece:
    text: str
    role: str  # the span role: "tool" for tool output, else "user" / "assistant" / "system"


@dataclass
class Turn:
    pieces: list[Piece]
    question: str | None = None
    """The expected answer when the turn asks a question (then it generates up to ``answer_tokens``)."""
    distance: int = 0
    """Turns between the fact asked about and this question."""


@dataclass
class Sample:
    family: str
    size: Size
    seed: int
    turns: list[Turn] = field(default_factory=list)

    @property
    def questions(self) -> list[tuple[int, Turn]]:
        return [(i, t) for i, t in enumerate(self.turns) if t.question is not None]


def _keys(rng: random.Random, n: int) -> list[str]:
    """``n`` distinct keys: single nouns while there are enough (a 135M model matches a one-word key
    far better than an adjective_noun pair, whose halves recur in other keys), else pairs."""
    if n <= len(NOUN):
        return rng.sample(NOUN, n)
    pairs = rng.sample([(a, b) for a in ADJ for b in NOUN], n)
    return [f"{a}_{b}" for a, b in pairs]


def _value(rng: random.Random, avoid: set[str] = frozenset()) -> str:
    while True:
        v = str(rng.randint(1000, 9999))
        if v not in avoid:
            return v


def _records(pairs: list[tuple[str, str]]) -> str:
    return "\n".join(f"{k}: {v}" for k, v in pairs)


def _head(family: str, **fmt) -> list[Piece]:
    return [
        Piece(
            f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n{TASK[family].format(**fmt)}<|im_end|>\n",
            "user",
        )
    ]


def _tool(text: str) -> list[Piece]:
    return [
        Piece("<|im_start|>assistant\nCalling the tool.<|im_end|>\n<|im_start|>tool\n", "assistant"),
        Piece(text, "tool"),
        Piece("<|im_end|>\n", "tool"),
    ]


def _ack() -> Piece:
    """The assistant's acknowledgement, less its ``<|im_end|>``: the turn generates that."""
    return Piece(f"<|im_start|>assistant\n{ACK}", "assistant")


def _ask(family: str, key: str) -> list[Piece]:
    return [
        Piece(f"<|im_start|>user\n{QUESTION[family].format(key=key)}<|im_end|>\n", "user"),
        Piece(f"<|im_start|>assistant\n{ANSWER_LEAD[family].format(key=key)}", "assistant"),
    ]


def _lead() -> Piece:
    """What a later turn starts with: the line break after the previous turn's ``<|im_end|>``."""
    return Piece("\n", "assistant")


def needle(size: Size, seed: int) -> Sample:
    rng = random.Random(f"needle-{size.label}-{seed}")
    keys = _keys(rng, size.turns * size.records)
    values = {k: _value(rng) for k in keys}
    outputs = [keys[i * size.records : (i + 1) * size.records] for i in range(size.turns)]
    target = rng.choice(outputs[0])
    s = Sample("needle", size, seed)
    for t, out in enumerate(outputs):
        pieces = (_head("needle") if t == 0 else [_lead()]) + _tool(_records([(k, values[k]) for k in out]))
        if t < size.turns - 1:
            s.turns.append(Turn(pieces + [_ack()]))
        else:
            s.turns.append(Turn(pieces + _ask("needle", target), question=values[target], distance=size.turns - 1))
    return s


def running_state(size: Size, seed: int) -> Sample:
    rng = random.Random(f"state-{size.label}-{seed}")
    keys = _keys(rng, size.turns * size.records + 1)
    target, fillers = keys[0], keys[1:]
    last_update = size.turns - 1 - size.lag
    if last_update < 0:
        raise ValueError(f"state: lag {size.lag} needs more than {size.turns} turns")
    value, seen = None, set()
    s = Sample("state", size, seed)
    for t in range(size.turns):
        pairs = [(k, _value(rng)) for k in fillers[t * size.records : (t + 1) * size.records - 1]]
        if t <= last_update:
            value = _value(rng, seen)
            seen.add(value)
            pairs.insert(rng.randrange(len(pairs) + 1), (target, value))
        else:
            pairs.append((fillers[(t + 1) * size.records - 1], _value(rng)))
        pieces = (_head("state", key=target) if t == 0 else [_lead()]) + _tool(_records(pairs))
        if t < size.turns - 1:
            s.turns.append(Turn(pieces + [_ack()]))
        else:
            s.turns.append(Turn(pieces + _ask("state", target), question=value, distance=size.lag))
    return s


def shared_context(size: Size, seed: int) -> Sample:
    """``size.turns - 1`` questions after the file, each about another section of it."""
    rng = random.Random(f"shared-{size.label}-{seed}")
    n_q = size.turns - 1
    keys = _keys(rng, size.records)
    values = {k: _value(rng) for k in keys}
    sections = [keys[i * size.records // n_q : (i + 1) * size.records // n_q] for i in range(n_q)]
    s = Sample("shared", size, seed)
    s.turns.append(Turn(_head("shared") + _tool(_records([(k, values[k]) for k in keys])) + [_ack()]))
    for q, sec in enumerate(sections):
        key = rng.choice(sec)
        s.turns.append(Turn([_lead(), *_ask("shared", key)], question=values[key], distance=q + 1))
    return s


BUILDERS = {"needle": needle, "state": running_state, "shared": shared_context}

SIZES = {
    # the test suite's: one size per family, the one SmolLM2 answers best (tests/test_agent_quality.py)
    "test": {"needle": [Size(2, 4)], "state": [Size(3, 3, lag=1)], "shared": [Size(3, 6)]},
    "tiny": {"needle": [Size(2, 4), Size(4, 4)], "state": [Size(3, 3, lag=1)], "shared": [Size(3, 6)]},
    # SmolLM2-135M (Q4_1) retrieves reliably only within ~200-300 tokens: dense re-prefill, 16 samples,
    # needle N2-r4 67-75%, N3-r2 69%, N4-r2 50%, N6-r2 31%, N2-r16 17%; state 13-38% at every size
    # tried (it answers the key's first value, not its latest); shared N4-r6 90%, N5-r8 97%.
    # (2 CPU cores: pick one size per family with --sizes, so every method x budget x pruning fits a run)
    "cpu": {"needle": [Size(3, 2)], "state": [Size(3, 2, lag=1)], "shared": [Size(4, 6), Size(5, 8)]},
    "full": {
        "needle": [Size(2, 4), Size(3, 2), Size(4, 2), Size(6, 2)],
        "state": [Size(3, 2, lag=1), Size(4, 2, lag=0), Size(4, 2, lag=2)],
        "shared": [Size(4, 6), Size(5, 8), Size(7, 12), Size(9, 16)],
    },
}


def make_samples(family: str, size: Size, n: int, seed: int) -> list[Sample]:
    return [BUILDERS[family](size, seed * 100003 + i) for i in range(n)]


def normalize(text: str) -> str:
    """The answer as scored: stripped of spaces, quotes and a trailing period."""
    return text.strip().strip("\"'`").rstrip(".").strip()


def is_correct(answer_text: str, expected: str) -> bool:
    return normalize(answer_text) == expected
