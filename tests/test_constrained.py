"""Structured output by grammar-constrained decoding (engine/constrained.py) on a tiny random model:
whatever the (random) logits, the reply parses and validates against the schema."""

from __future__ import annotations

import json
import math

import jsonschema
import pytest

from engine.constrained import Constraint, ConstraintError
from engine.sampling import SamplingError, SamplingParams

from tests.conftest import make_engine

SCHEMA = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "color": {"enum": ["red", "green", "blue"]},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
    },
    "required": ["ok", "color", "n", "tags"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def engine(tiny_chat_dir):
    return make_engine(tiny_chat_dir, num_pages=4000, prefill_chunk_size=64, max_model_len=1024)


def _prompt(engine, text):
    return engine.apply_chat_template([{"role": "user", "content": text}])


def test_json_schema_output_validates_greedy_and_sampled(engine):
    c = Constraint.json_schema(SCHEMA)
    prompts = [_prompt(engine, f"question {i}") for i in range(4)]
    params = [
        SamplingParams(max_tokens=300, temperature=t, seed=i, constraint=c) for i, t in enumerate([0, 0.7, 1.3, 2.0])
    ]
    outs = engine.generate(prompts, params)
    for o in outs:
        assert o.finish_reason == "stop", o.text
        jsonschema.validate(json.loads(o.text), SCHEMA)
    # the same request without the constraint is not JSON (a random model)
    free = engine.generate([prompts[0]], SamplingParams(max_tokens=40))[0]
    with pytest.raises(ValueError):
        json.loads(free.text)


def _allowed(engine, matcher) -> list[int]:
    """The tokens ``matcher`` lets the next step sample (its row of apply_masks on zero logits)."""
    import torch

    logits = torch.zeros(1, engine.model_config.vocab_size)
    engine.grammars.apply_masks(logits, [matcher])
    return torch.isfinite(logits[0]).nonzero().flatten().tolist()


def test_forced_text_is_written_in_whole_vocabulary_tokens(engine):
    """Where the grammar forces text (a tool call's frame, a JSON key), the mask allows exactly one token:
    the first of xgrammar's longest-token split of that text; a random model's reply then holds the frame
    in those tokens. Without forced_whole_tokens some of those places allow the text's other spellings."""
    c = Constraint.json_schema(SCHEMA, prefix="<tool_call>\n")
    m = engine.grammars.matcher(c)
    forced = m.inner.find_jump_forward_tokens()
    spelled_otherwise = 0
    for _ in forced:  # walk the forced prefix token by token
        head = m.inner.find_jump_forward_tokens()[0]
        assert _allowed(engine, m) == [head]
        engine.grammars.forced_whole_tokens = False
        try:
            spelled_otherwise += len(_allowed(engine, m)) > 1
        finally:
            engine.grammars.forced_whole_tokens = True
        assert m.advance(head)
    assert spelled_otherwise > 0
    out = engine.generate(
        [_prompt(engine, "go")], SamplingParams(max_tokens=300, temperature=1.0, seed=1, constraint=c)
    )[0]
    assert out.token_ids[: len(forced)] == forced  # the whole forced prefix, token for token
    if out.finish_reason == "stop":
        jsonschema.validate(json.loads(out.text[len("<tool_call>\n") :]), SCHEMA)


def test_a_forced_token_in_the_top_bit_of_its_bitmask_word():
    """The bitmask's words are int32: a forced token whose bit is 31 sets the sign bit."""
    import torch

    from engine.constrained import _force_whole_token

    class Forced:  # the one matcher method the function reads
        def __init__(self, tokens):
            self.inner = self
            self.tokens = tokens

        def find_jump_forward_tokens(self):
            return self.tokens

    for t in (31, 63, 32, 0):
        row = torch.full((3,), -1, dtype=torch.int32)  # every token allowed
        _force_whole_token(row, Forced([t, 5]))
        allowed = [w * 32 + b for w in range(3) for b in range(32) if (int(row[w]) >> b) & 1]
        assert allowed == [t]
    row = torch.tensor([0b10, 0, 0], dtype=torch.int32)  # only token 1 allowed: a forced 5 is not applied
    _force_whole_token(row, Forced([5]))
    assert row.tolist() == [0b10, 0, 0]


def test_the_string_loop_guard_follows_quotes_and_escapes():
    from engine.string_loop_guard import StringLoopGuard, closing_words

    vocab = [b'{"a": "', b"cat", b" is", b"\\", b'"', b'", "', b'"}', b" a", b'\\"']
    g = StringLoopGuard(vocab, window=2)
    for t in (0, 1, 2, 1, 2):  # '{"a": "cat is cat is': the run "cat is" came back
        g.feed(t)
    assert g.looping and g.must_close
    g.feed(3)  # a backslash: the next quote would be escaped, not a close
    assert not g.must_close
    g.feed(4)  # ... so this quote is text, and the string goes on
    assert g.in_string
    g.feed(5)  # '", "' closes it and opens the next: a new string, not looping
    assert g.in_string and not g.looping and g.tokens == [5]
    g.feed(6)
    assert not g.in_string and not g.must_close
    row = closing_words(vocab, 40)
    assert [t for t in range(40) if (int(row[t // 32]) >> (t % 32)) & 1] == [4, 5, 6]


def test_a_json_string_that_repeats_itself_is_closed(engine):
    """Once a JSON string's last STRING_LOOP_WINDOW tokens already appeared in it, the mask allows only the
    tokens that close it (those beginning with a quote that the grammar allows); before the loop the
    string may go on, and a string the grammar does not let end yet (minLength) is left as it is."""
    from engine.constrained import STRING_LOOP_WINDOW as W

    loop = engine.tokenizer.encode(" A cat is a cat, and it was a cat," * 4, add_special_tokens=False)
    # the loop is noticed once its last W tokens are a run that ended earlier in the string
    noticed = next(i for i in range(W, len(loop)) if tuple(loop[i - W : i]) in _runs(loop[: i - 1], W))
    for min_length, closes in ((0, True), (1000, False)):
        text = {"type": "string", "minLength": min_length} if min_length else {"type": "string"}
        schema = {"type": "object", "properties": {"setup": text, "n": {"type": "integer"}}, "required": ["setup"]}
        m = engine.grammars.matcher(Constraint.json_schema(schema))
        while m.inner.find_jump_forward_tokens():  # '{"setup":'
            assert m.advance(m.inner.find_jump_forward_tokens()[0])
        assert m.advance(engine.tokenizer.encode(' "', add_special_tokens=False)[0]) and m.guard.in_string
        for t in loop[:noticed]:
            assert not m.guard.looping
            quoted = {engine.tokenizer.decode([a]).startswith('"') for a in _allowed(engine, m)}
            assert quoted == ({True, False} if closes else {False})
            assert m.advance(t)
        assert m.guard.looping, "the loop was not noticed"
        quoted = {engine.tokenizer.decode([a]).startswith('"') for a in _allowed(engine, m)}
        assert quoted == ({True} if closes else {False})  # closed at once, or left to the grammar
        if closes:
            close = engine.tokenizer.encode('",', add_special_tokens=False)
            assert len(close) == 1 and close[0] in _allowed(engine, m) and m.advance(close[0])
            assert not m.guard.looping and not m.guard.in_string


def _runs(tokens: list[int], n: int) -> set[tuple[int, ...]]:
    return {tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1)}


def test_json_object_and_affixes(engine):
    c = Constraint("json_object", prefix="<tool_call>\n", suffix="\n</tool_call>")
    o = engine.generate(
        [_prompt(engine, "call it")], SamplingParams(max_tokens=400, temperature=0.8, seed=3, constraint=c)
    )[0]
    if o.finish_reason == "stop":  # a random model may nest objects past max_tokens
        assert o.text.startswith("<tool_call>\n") and o.text.endswith("\n</tool_call>")
        assert isinstance(json.loads(o.text[len("<tool_call>\n") : -len("\n</tool_call>")]), dict)
    else:
        assert o.text.startswith("<tool_call>\n{")


def test_regex_constraint_and_session_turns(engine):
    c = Constraint("regex", r"(yes|no), [0-9]{1,3}")
    sid = "constrained-session"
    engine.add_turn(sid, _prompt(engine, "answer"), SamplingParams(max_tokens=20, constraint=c))
    first = _drain(engine, sid)
    assert first.finish_reason == "stop"
    assert first.text.split(", ")[0] in ("yes", "no") and first.text.split(", ")[1].isdigit()
    # the next turn of the same session is free again, then constrained again
    more = engine.encode("<|im_start|>user\nagain<|im_end|>\n<|im_start|>assistant\n")
    engine.add_turn(sid, more, SamplingParams(max_tokens=8, ignore_eos=True))
    assert len(_drain(engine, sid).token_ids) == 8
    engine.add_turn(sid, more, SamplingParams(max_tokens=20, temperature=1.0, seed=5, constraint=c))
    third = _drain(engine, sid)
    assert third.finish_reason == "stop" and third.text.split(", ")[0] in ("yes", "no")
    engine.end_session(sid)


def test_constrained_and_free_rows_share_a_batch(engine):
    """A constrained sequence beside free ones: each free row's tokens are those it gets alone."""
    free_params = SamplingParams(max_tokens=10, ignore_eos=True)
    p_free = _prompt(engine, "free text")
    alone = engine.generate([p_free], free_params)[0].token_ids
    outs = engine.generate(
        [p_free, _prompt(engine, "json")],
        [free_params, SamplingParams(max_tokens=300, constraint=Constraint.json_schema(SCHEMA))],
    )
    assert outs[0].token_ids == alone
    jsonschema.validate(json.loads(outs[1].text), SCHEMA)


@pytest.mark.parametrize(
    "bad",
    [
        lambda: Constraint("xml", "<a/>"),
        lambda: Constraint("json_schema", ""),
        lambda: Constraint("json_schema", "{not json"),
        lambda: Constraint("json_schema", "[1, 2]"),
        lambda: Constraint("json_schema", "{" * 5000 + "}" * 5000),
        lambda: Constraint.json_schema(_deep(100)),
        lambda: Constraint("regex", "x" * (300 * 1024)),
        lambda: Constraint("json_object", prefix="p" * 1000),
    ],
)
def test_hostile_constraints_are_refused(bad):
    with pytest.raises(ConstraintError):
        bad()


def test_uncompilable_constraints_are_refused_by_the_engine(engine):
    for c in [
        Constraint("regex", "(unclosed"),
        Constraint("grammar", "root ::= ("),
        Constraint.json_schema({"type": "no-such-type"}),
    ]:
        with pytest.raises(ConstraintError):
            engine.add_request(_prompt(engine, "x"), SamplingParams(constraint=c))
    assert not engine.has_unfinished()


@pytest.mark.parametrize("value", [math.nan, math.inf, -1.0])
def test_non_finite_sampling_values_are_refused(value):
    with pytest.raises(SamplingError):
        SamplingParams(temperature=value)
    with pytest.raises(SamplingError):
        SamplingParams(top_p=value)


def _deep(n):
    schema: dict = {"type": "string"}
    for _ in range(n):
        schema = {"type": "object", "properties": {"x": schema}}
    return schema


def _drain(engine, sid):
    last = None
    while engine.has_unfinished():
        for o in engine.step():
            if o.request_id == sid and o.finished:
                last = o
    return last


PROMPTS = [
    "Describe a cat.",
    "What is 2+2?",
    "Name a color.",
    "Is the sky green?",
    "Rate the movie Alien.",
    "Give me a fruit.",
    "Tell me about Paris.",
    "How many legs has a spider?",
    "Pick a random word.",
    "Is water wet?",
    "What is the capital of Japan?",
    "Summarize: the quick brown fox.",
    "Say hello.",
    "Recommend a book.",
    "What day follows Monday?",
    "Describe the ocean.",
    "Is 7 prime?",
    "Name an animal that flies.",
    "What is your favourite number?",
    "Translate 'chat' from French.",
]
REVIEW = {
    "type": "object",
    "properties": {
        "topic": {"type": "string", "maxLength": 40},
        "sentiment": {"enum": ["positive", "neutral", "negative"]},
        "score": {"type": "integer", "minimum": 1, "maximum": 10},
        "facts": {"type": "array", "items": {"type": "string", "maxLength": 40}, "maxItems": 3},
    },
    "required": ["topic", "sentiment", "score", "facts"],
    "additionalProperties": False,
}


@pytest.mark.slow
def test_smollm2_json_schema_on_twenty_prompts(smol_engine):
    c = Constraint.json_schema(REVIEW)
    prompts = [_prompt(smol_engine, p + " Answer in JSON.") for p in PROMPTS]
    params = [
        SamplingParams(max_tokens=160, temperature=0.0 if i % 2 else 0.7, seed=i, constraint=c)
        for i in range(len(PROMPTS))
    ]
    outs = list(smol_engine.generate(prompts, params))
    for o in outs:  # the guarantee: the reply matches unless max_tokens cut it short
        assert o.finish_reason in ("stop", "length"), o.finish_reason
        if o.finish_reason == "stop":
            jsonschema.validate(json.loads(o.text), REVIEW)
    # a sampled reply may spend its 160 tokens inside 40-character strings (emoji are several tokens each)
    assert sum(o.finish_reason == "stop" for o in outs) >= 16, [o.text for o in outs if o.finish_reason != "stop"]


@pytest.mark.slow
def test_smollm2_forced_tool_calls_are_well_formed(smol_engine):
    from sidecar.turns.chat import ChatRenderer, ToolSpec
    from sidecar.turns.structured import tool_call_constraint
    from sidecar.turns.tool_calls import ToolCallParser

    tools = [
        ToolSpec(
            "get_weather",
            "Current weather in a city",
            {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "maxLength": 30},
                    "unit": {"enum": ["celsius", "fahrenheit"]},
                },
                "required": ["city", "unit"],
            },
        ),
        ToolSpec(
            "calculator",
            "Evaluate arithmetic",
            {
                "type": "object",
                "properties": {"expression": {"type": "string", "maxLength": 40}},
                "required": ["expression"],
            },
        ),
    ]
    renderer = ChatRenderer(smol_engine.tokenizer, smol_engine.eos_token_ids)
    questions = PROMPTS[:6]
    prompts = [renderer.first_turn([{"role": "user", "content": q}], tools).token_ids for q in questions]
    c = tool_call_constraint(tools)
    outs = smol_engine.generate(
        prompts, [SamplingParams(max_tokens=90, temperature=0.5, seed=i, constraint=c) for i in range(len(prompts))]
    )
    for o in outs:
        parser = ToolCallParser([t.name for t in tools])
        events = parser.feed(o.text) + parser.finish()
        calls = [v for k, v in events if k == "tool_call"]
        assert o.finish_reason == "stop" and len(calls) == 1, o.text
        schema = next(t.parameters for t in tools if t.name == calls[0].name)
        jsonschema.validate(json.loads(calls[0].arguments_json), schema)
