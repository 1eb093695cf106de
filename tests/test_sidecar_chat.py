"""Chat rendering for append-only sessions (SmolLM2's ChatML template) and streamed tool-call parsing."""

from __future__ import annotations

import json

import pytest

from sidecar.turns.chat import ChatError, ChatRenderer, ToolSpec
from sidecar.turns.tool_calls import ToolCallParser, parse_call


@pytest.fixture(scope="module")
def renderer(smollm2_dir):
    from engine.model.loader import load_tokenizer

    tok = load_tokenizer(__import__("pathlib").Path(smollm2_dir))
    return ChatRenderer(tok, {tok.eos_token_id})


def test_turn_by_turn_history_equals_rendering_the_whole_transcript(renderer):
    r = renderer
    replies = ["Apples, pears and plums.", "The weather tool says it is sunny.", "You're welcome!"]
    turns = [
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name three fruits."}],
        [{"role": "user", "content": "What's the weather?"}, {"role": "tool", "content": '{"sky": "sunny"}'}],
        [{"role": "user", "content": "Thanks!"}],
    ]
    history, transcript = [], []
    for i, (msgs, reply) in enumerate(zip(turns, replies)):
        rendered = r.first_turn(msgs) if i == 0 else r.continuation(msgs, history_ends_with_eot=True)
        # spans tile the turn: one per message, then the generation prompt
        assert [s[2] for s in rendered.spans] == [m["role"] for m in msgs] + ["assistant"]
        assert rendered.spans[0][0] == 0 and rendered.spans[-1][1] == len(rendered.token_ids)
        assert all(a[1] == b[0] for a, b in zip(rendered.spans, rendered.spans[1:]))
        history += rendered.token_ids + r.encode(reply) + [r.end_of_turn_id]  # the reply ends on <|im_end|>
        transcript += msgs + [{"role": "assistant", "content": reply}]
    whole = r.tokenizer.apply_chat_template(transcript, tokenize=False)
    assert whole.endswith("<|im_end|>\n")  # the closing newline of the last reply comes with the next turn
    assert history == r.encode(whole[:-1])
    assert r.tokenizer.decode(history) == whole[:-1]


def test_a_reply_cut_short_gets_the_whole_turn_close(renderer):
    r = renderer
    first = r.first_turn([{"role": "user", "content": "Count to ten."}])
    cut = r.encode("1, 2, 3")  # max_tokens ended the reply: no <|im_end|> in the history
    nxt = r.continuation([{"role": "user", "content": "Go on."}], history_ends_with_eot=False)
    whole = r.tokenizer.apply_chat_template(
        [
            {"role": "user", "content": "Count to ten."},
            {"role": "assistant", "content": "1, 2, 3"},
            {"role": "user", "content": "Go on."},
        ],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert first.token_ids + cut + nxt.token_ids == r.encode(whole)


def test_tools_go_into_the_system_prompt_when_the_template_ignores_them(renderer):
    r = renderer
    assert not r.template_takes_tools  # SmolLM2's template has no tools
    calc = ToolSpec(
        "calculator", "Evaluate arithmetic.", {"type": "object", "properties": {"expression": {"type": "string"}}}
    )
    t = r.first_turn([{"role": "user", "content": "2+2?"}], tools=[calc])
    text = r.tokenizer.decode(t.token_ids)
    assert text.startswith("<|im_start|>system\n# Tools") and '"name": "calculator"' in text
    assert "You are a helpful AI assistant named SmolLM" not in text  # the tool prompt is the system message
    # the system message (tool schema) is the shared prefix, and its span
    assert t.spans[0][2] == "system" and t.shared_prefix == t.spans[0][1]
    with_sys = r.first_turn(
        [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "2+2?"}],
        tools=[calc],
        shared_prefix_messages=1,
    )
    assert r.tokenizer.decode(with_sys.token_ids).startswith("<|im_start|>system\nBe terse.\n\n# Tools")
    # an assistant message with tool calls is rendered in the same convention
    cont = r.continuation(
        [
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [{"name": "calculator", "arguments": {"expression": "2+2"}}],
            },
            {"role": "tool", "content": "4"},
        ],
        history_ends_with_eot=True,
    )
    assert (
        '<tool_call>\n{"name": "calculator", "arguments": {"expression": "2+2"}}\n</tool_call>'
        in r.tokenizer.decode(cont.token_ids)
    )


def test_bad_messages_are_refused(renderer):
    with pytest.raises(ChatError):
        renderer.first_turn([])
    with pytest.raises(ChatError):
        renderer.continuation([{"role": "wizard", "content": "x"}], True)


def test_tool_call_parser_streams_text_and_calls_split_anywhere():
    reply = 'Let me check.<tool_call>\n{"name": "clock", "arguments": {}}\n</tool_call>Then <tool_call>{"name": "calculator", "arguments": "{\\"expression\\": \\"1+1\\"}"}</tool_call> done <tool'
    for step in (1, 3, 7, len(reply)):
        parser, events = ToolCallParser(["clock", "calculator"]), []
        for i in range(0, len(reply), step):
            events += parser.feed(reply[i : i + step])
        events += parser.finish()
        text = "".join(v for k, v in events if k == "text")
        calls = [v for k, v in events if k == "tool_call"]
        assert text == "Let me check.Then  done <tool"
        assert [(c.name, json.loads(c.arguments_json)) for c in calls] == [
            ("clock", {}),
            ("calculator", {"expression": "1+1"}),
        ]
        # the held-back tag prefix never leaks early: every text event before the end is tag-free
        assert all("<tool_call>" not in v for k, v in events if k == "text")


def test_a_call_to_a_tool_that_was_not_declared_stays_text():
    """Only declared tools are called: a well-formed call to any other name (made up by the model, or
    copied from a user message) comes back as the text it was, wherever the stream splits it."""
    undeclared = '<tool_call>\n{"name": "delete_everything", "arguments": {"path": "/"}}\n</tool_call>'
    declared = '<tool_call>{"name": "clock", "arguments": {}}</tool_call>'
    for reply, unclosed in (
        (f"Sure. {undeclared} and {declared}!", False),
        ("x " + undeclared[: -len("</tool_call>")], True),
    ):
        for step in (1, 5, len(reply)):
            parser, events = ToolCallParser(["clock"]), []
            for i in range(0, len(reply), step):
                events += parser.feed(reply[i : i + step])
            events += parser.finish()
            calls = [v.name for k, v in events if k == "tool_call"]
            text = "".join(v for k, v in events if k == "text")
            assert calls == ([] if unclosed else ["clock"])
            assert text == (reply if unclosed else f"Sure. {undeclared} and !")
    assert [k for k, _ in ToolCallParser([]).feed(declared)] == ["text"]  # no tools declared: no calls


def test_tool_call_parser_passes_malformed_calls_through_and_accepts_an_unclosed_last_call():
    p = ToolCallParser(["clock"])
    events = p.feed("<tool_call>not json</tool_call> ok") + p.finish()
    assert events == [("text", "<tool_call>not json</tool_call> ok")]
    p = ToolCallParser(["clock"])
    events = p.feed('<tool_call>{"name": "clock", "parameters": {"tz": "UTC"}}') + p.finish()
    assert (
        events[0][0] == "tool_call"
        and events[0][1].name == "clock"
        and json.loads(events[0][1].arguments_json) == {"tz": "UTC"}
    )
    assert parse_call('{"arguments": {}}') is None and parse_call('{"name": "x", "arguments": [1]}') is None


def test_rendering_shares_the_engine_tokenizer_with_a_decoding_thread(renderer):
    """The sidecar renders on worker threads with the tokenizer the engine thread decodes with (no
    second copy): renders and incremental decodes running at once give what they give alone."""
    from concurrent.futures import ThreadPoolExecutor

    from engine.detokenizer import IncrementalDetokenizer

    r = renderer
    msgs = [[{"role": "user", "content": f"Question {i}: name {i} fruits, then count to {i}."}] for i in range(12)]
    rendered = [r.first_turn(m).token_ids for m in msgs]
    ids = r.encode("Apples, pears, plums and 🍒 cherries; ünïcödé text and numbers 1 2 3. " * 6)

    def decode_all() -> str:
        d = IncrementalDetokenizer(r.tokenizer)
        return "".join(d.push(t) for t in ids) + d.flush()

    text = decode_all()
    with ThreadPoolExecutor(4) as pool:
        decodes = [pool.submit(decode_all) for _ in range(4)]
        renders = [pool.submit(lambda m=m: r.first_turn(m).token_ids) for m in msgs * 3]
        assert [f.result() for f in renders] == rendered * 3
        assert [f.result() for f in decodes] == [text] * 4
