"""Chat rendering for sessions: only a turn's new messages become tokens, appended to the history.

A session's history is append-only token ids: the first turn's messages rendered with the model's
chat template (generation prompt included), the reply the engine generated, the next turn's
messages, and so on. Re-rendering the whole transcript every turn would let the tokenizer move
token boundaries in text that is already cached; rendering only the new messages cannot.

How a continuation is rendered. The template is probed once with a small sentinel conversation
``[system, user, assistant]``. Rendering that conversation plus the new messages and cutting off
the probe's own rendering leaves exactly the text the template puts after a finished assistant
reply: for ChatML (SmolLM2, Qwen) ``"<|im_start|>user\\n...<|im_end|>\\n<|im_start|>assistant\\n"``.
The probe also shows what the template writes right after an assistant's content (ChatML:
``"<|im_end|>\\n"``). A reply that ended on the end-of-turn token (``<|im_end|>``, an EOS token)
already has that token in the history, so the continuation starts with the rest (``"\\n"``); a
reply cut short (max_tokens, a stop string) gets the whole closing text. The history is then
token for token the rendering of the whole transcript whose assistant messages are the generated
replies, because every piece boundary sits next to a special token that the tokenizer splits on
(tests/test_sidecar_chat.py checks this on SmolLM2). Templates that render an earlier message
differently once later messages exist (some strip earlier reasoning) are not prefix-stable; the
renderer refuses them with a clear error rather than silently drifting.

Tools. Templates that take ``tools`` (Qwen2.5, Hermes) get them; for templates that ignore them
(SmolLM2's) the tool schema is written into the system prompt in the Hermes convention, and the
model is asked to answer with ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
(parsed back by ``sidecar.turns.tool_calls``).
"""

from __future__ import annotations

import bisect
import copy
import hashlib
import json
import threading
from dataclasses import dataclass, field
from typing import Any

from sidecar.turns.validation import loads_bounded as _loads_bounded

ROLES = ("system", "user", "assistant", "tool")

_S, _U, _A = "chainkvProbeSystemQ7", "chainkvProbeUserQ7", "chainkvProbeAssistantQ7"
_PROBE = [{"role": "system", "content": _S}, {"role": "user", "content": _U}, {"role": "assistant", "content": _A}]

HERMES_TOOL_PROMPT = """# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{tools}
</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""


class ChatError(ValueError):
    """Messages or tools that cannot be rendered (bad role, bad schema, unsupported template)."""


@dataclass
class RenderedTurn:
    token_ids: list[int]
    spans: list[tuple[int, int, str]]
    """(start, end, role) over ``token_ids``: one span per message, plus the generation prompt."""
    shared_prefix: int = 0
    """Leading tokens that many sessions share (the system prompt and tool schema)."""


@dataclass
class ToolSpec:
    name: str
    description: str = ""
    parameters: dict[str, Any] = field(default_factory=dict)

    def openai(self) -> dict[str, Any]:
        fn: dict[str, Any] = {"name": self.name, "description": self.description}
        fn["parameters"] = self.parameters or {"type": "object", "properties": {}}
        return {"type": "function", "function": fn}


def tool_from_json(name: str, description: str, parameters_json: str) -> ToolSpec:
    if not name:
        raise ChatError("a tool needs a name")
    try:
        params = _loads_bounded(parameters_json) if parameters_json else {}
    except json.JSONDecodeError as e:
        raise ChatError(f"tool {name!r}: parameters_json is not JSON ({e.msg})") from None
    except ValueError as e:  # JsonTooDeep
        raise ChatError(f"tool {name!r}: parameters_json: {e}") from None
    if not isinstance(params, dict):
        raise ChatError(f"tool {name!r}: parameters_json must be a JSON object (a JSON Schema)")
    return ToolSpec(name, description, params)


def tools_digest(tools: list[ToolSpec]) -> str:
    return hashlib.sha256(json.dumps([t.openai() for t in tools], sort_keys=True).encode()).hexdigest() if tools else ""


class ChatRenderer:
    """Renders a session's turns with one tokenizer's chat template (see the module docstring)."""

    def __init__(self, tokenizer: Any, eos_token_ids: set[int]):
        if tokenizer is None or not getattr(tokenizer, "chat_template", None):
            raise ChatError("the model has no chat template; the sidecar needs one")
        self.tokenizer = tokenizer
        self.eos_token_ids = set(eos_token_ids)
        self._local = threading.local()  # each rendering thread has its own copy of the tokenizer:
        self._copy_lock = threading.Lock()  # one session's long render never waits on another's
        self._probe_text = self._render(_PROBE, None, False)
        at = self._probe_text.rfind(_A)
        if at < 0:
            raise ChatError("the chat template does not render assistant content verbatim")
        self.reply_close = self._probe_text[at + len(_A) :]
        """What the template writes right after an assistant reply's content (ChatML: "<|im_end|>\\n")."""
        close_ids = self.encode(self.reply_close)
        self.end_of_turn_id = close_ids[0] if close_ids and close_ids[0] in self.eos_token_ids else None
        """The token a reply ends on when the model closes its turn (ChatML: <|im_end|>)."""
        self._after_eot = ""
        if self.end_of_turn_id is not None:
            eot_text = self.tokenizer.decode([self.end_of_turn_id])
            if not self.reply_close.startswith(eot_text):
                raise ChatError("the chat template's end-of-turn text does not start with its EOS token")
            self._after_eot = self.reply_close[len(eot_text) :]
        probe_user = [{"role": "user", "content": _U}]
        tool = ToolSpec("chainkv_probe_tool", "probe").openai()
        self.template_takes_tools = self._render(probe_user, [tool], True) != self._render(probe_user, None, True)

    def _tok(self) -> Any:
        """This thread's copy of the tokenizer (HF fast tokenizers are not safe to share across threads)."""
        tok = getattr(self._local, "tokenizer", None)
        if tok is None:
            with self._copy_lock:
                tok = self._local.tokenizer = copy.deepcopy(self.tokenizer)
        return tok

    # --- public ---------------------------------------------------------------------------------
    def first_turn(
        self, messages: list[dict], tools: list[ToolSpec] | None = None, shared_prefix_messages: int | None = None
    ) -> RenderedTurn:
        """A new session's first turn: the messages (and tools) rendered as a whole conversation."""
        return self._first_turn(messages, tools, shared_prefix_messages)

    def continuation(self, messages: list[dict], history_ends_with_eot: bool) -> RenderedTurn:
        """The next turn of a session whose history ends with a generated reply."""
        return self._continuation(messages, history_ends_with_eot)

    def _first_turn(self, messages, tools, shared_prefix_messages) -> RenderedTurn:
        messages = self._check(messages)
        tool_dicts = [t.openai() for t in tools] if tools else None
        if tool_dicts and not self.template_takes_tools:
            messages, inserted = self._with_tool_prompt(messages, tool_dicts)
            tool_dicts = None
            if inserted and shared_prefix_messages is not None:
                shared_prefix_messages += 1
        messages = [self._plain(m) for m in messages]
        text = self._render(messages, tool_dicts, True)
        cuts = [0] + self._cuts(text, messages, lambda k: self._render(messages[:k], tool_dicts, False))
        n_shared = shared_prefix_messages if shared_prefix_messages is not None else _leading_system(messages)
        return self._tokens(text, cuts, messages, n_shared)

    def _continuation(self, messages: list[dict], history_ends_with_eot: bool) -> RenderedTurn:
        messages = [self._plain(m) for m in self._check(messages)]
        full = self._render(_PROBE + messages, None, True)
        prefixes = self._cuts(
            full, messages, lambda k: self._render(_PROBE + messages[:k], None, False), first=self._probe_text
        )
        base = len(self._probe_text)
        lead = self._after_eot if history_ends_with_eot else self.reply_close
        text = lead + full[base:]
        cuts = [0] + [len(lead) + c - base for c in prefixes]
        return self._tokens(text, cuts, messages, 0)

    def _cuts(self, text: str, messages: list[dict], render_prefix, first: str | None = None) -> list[int]:
        """Where each message's rendering ends in ``text``; checks that the template is prefix-stable
        (rendering more messages never changes how the earlier ones render)."""
        pieces = ([first] if first is not None else []) + [render_prefix(k) for k in range(1, len(messages) + 1)]
        for piece in pieces:
            if not text.startswith(piece):
                raise ChatError(
                    "the chat template renders earlier messages differently once new ones follow; "
                    "it cannot be used for append-only sessions"
                )
        return [len(p) for p in pieces[1 if first is not None else 0 :]]

    def encode(self, text: str) -> list[int]:
        return list(self._tok().encode(text, add_special_tokens=False))

    # --- internals --------------------------------------------------------------------------------
    def _render(self, messages: list[dict], tools: list[dict] | None, generation_prompt: bool) -> str:
        kwargs = {"tools": tools} if tools else {}
        try:
            return self._tok().apply_chat_template(
                messages, tokenize=False, add_generation_prompt=generation_prompt, **kwargs
            )
        except Exception as e:  # jinja raises its own errors (e.g. a template that demands alternation)
            raise ChatError(f"the chat template rejected the messages: {e}") from None

    def _check(self, messages: list[dict]) -> list[dict]:
        if not messages:
            raise ChatError("a turn needs at least one message")
        for m in messages:
            if m.get("role") not in ROLES:
                raise ChatError(f"unknown message role {m.get('role')!r}; use one of {', '.join(ROLES)}")
        return list(messages)

    def _plain(self, m: dict) -> dict:
        """A message as the template sees it; tool calls become Hermes text when it cannot take them."""
        out = {"role": m["role"], "content": m.get("content", "")}
        for key in ("name", "tool_call_id"):
            if m.get(key):
                out[key] = m[key]
        calls = m.get("tool_calls") or []
        if calls:
            if self.template_takes_tools:
                out["tool_calls"] = [
                    {
                        "id": c.get("id", ""),
                        "type": "function",
                        "function": {"name": c["name"], "arguments": c.get("arguments", {})},
                    }
                    for c in calls
                ]
            else:
                text = "".join(
                    "\n<tool_call>\n"
                    + json.dumps({"name": c["name"], "arguments": c.get("arguments", {})})
                    + "\n</tool_call>"
                    for c in calls
                )
                out["content"] = (out["content"] + text).lstrip("\n")
        return out

    def _with_tool_prompt(self, messages: list[dict], tools: list[dict]) -> tuple[list[dict], bool]:
        """The tool schema written into the system prompt (Hermes); True when a system message was added."""
        block = HERMES_TOOL_PROMPT.format(tools="\n".join(json.dumps(t) for t in tools))
        if messages[0]["role"] == "system":
            first = dict(messages[0], content=(messages[0].get("content") or "") + "\n\n" + block)
            return [first] + messages[1:], False
        return [{"role": "system", "content": block}] + messages, True

    def _tokens(self, text: str, cuts: list[int], messages: list[dict], n_shared: int) -> RenderedTurn:
        enc = self._tok()(text, add_special_tokens=False, return_offsets_mapping=True)
        ids, offsets = list(enc["input_ids"]), enc["offset_mapping"]

        starts = [a for a, _ in offsets]
        bounds = [bisect.bisect_left(starts, c) for c in cuts] + [len(ids)]  # first token starting at/after c
        roles = [m["role"] for m in messages] + ["assistant"]  # the last piece: the generation prompt
        spans = [(a, b, r) for a, b, r in zip(bounds, bounds[1:], roles) if b > a]
        n_shared = max(0, min(n_shared, len(messages)))
        shared = bounds[n_shared] if n_shared else 0
        return RenderedTurn(ids, spans, shared)


def _leading_system(messages: list[dict]) -> int:
    n = 0
    for m in messages:
        if m["role"] != "system":
            break
        n += 1
    return n
