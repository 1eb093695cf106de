"""LlamaIndex LLM backed by the chainkv sidecar: ``ChainKVLLM`` (a function-calling chat model).

    from agent_adapters.llamaindex import ChainKVLLM
    from llama_index.core.chat_engine import SimpleChatEngine

    llm = ChainKVLLM(target="127.0.0.1:50051", session_id="run-42", max_tokens=128)
    engine = SimpleChatEngine.from_defaults(llm=llm)
    engine.chat("Hello")

Sessions. ``chat`` / ``stream_chat`` / ``achat`` / ``astream_chat`` continue the sidecar session
keyed by ``session_id`` (the field, or a ``session_id=`` keyword per call) and send only the
messages it has not seen (``agent_adapters.ledger``). Without a key a call is stateless (a
throwaway session), as is ``complete`` (one user message). A chat engine whose memory drops old
messages hands over a history that no longer extends the session's; the adapter then continues
on a fresh session (see the ledger).

Tools. ``chat_with_tools`` / ``predict_and_call`` / function-calling agents pass LlamaIndex tools;
they are sent on the session's first turn, and the reply's calls come back as ``ToolCallBlock``s
(and OpenAI-style ``additional_kwargs["tool_calls"]``); ``get_tool_calls_from_response`` reads them.
``tool_required=True`` (what ``structured_predict``'s function-calling program asks for) or a
``tool_choice`` forces one call, decoded under a grammar so its arguments validate against the
tool's schema; ``response_format=`` (OpenAI shape) constrains a plain chat's reply.

``metadata`` (context window, model name, chat + function calling) comes from the sidecar's
``GetServerInfo`` on first use, unless ``context_window`` / ``model_name`` are set.
"""

from __future__ import annotations

import json
from typing import Any, AsyncGenerator, Generator, Sequence

from llama_index.core.base.llms.types import (
    ChatMessage as LIMessage,
    ChatResponse,
    ChatResponseAsyncGen,
    ChatResponseGen,
    CompletionResponse,
    CompletionResponseAsyncGen,
    CompletionResponseGen,
    LLMMetadata,
    MessageRole,
    TextBlock,
    ToolCallBlock,
)
from llama_index.core.bridge.pydantic import ConfigDict, Field, PrivateAttr, SecretStr
from llama_index.core.llms.callbacks import llm_chat_callback, llm_completion_callback
from llama_index.core.llms.function_calling import FunctionCallingLLM
from llama_index.core.llms.llm import ToolSelection

from agent_adapters.conversation import Conversations, turn_options
from agent_adapters.messages import ChatMessage, TextDelta, ToolCall, ToolSpec, TurnResult, as_tool
from agent_adapters.output_format import named_tool_choice


def _tool_calls_of(m: LIMessage) -> tuple[ToolCall, ...]:
    calls = [
        ToolCall(
            b.tool_call_id or "",
            b.tool_name,
            json.loads(b.tool_kwargs) if isinstance(b.tool_kwargs, str) else dict(b.tool_kwargs),
        )
        for b in m.blocks
        if isinstance(b, ToolCallBlock)
    ]
    if not calls:
        for c in m.additional_kwargs.get("tool_calls") or []:
            fn = c.get("function", c)
            args = fn.get("arguments", {})
            calls.append(
                ToolCall(c.get("id", ""), fn["name"], json.loads(args) if isinstance(args, str) else dict(args))
            )
    return tuple(calls)


def to_chat_message(m: LIMessage) -> ChatMessage:
    role = m.role.value if isinstance(m.role, MessageRole) else str(m.role)
    role = {"chatbot": "assistant", "model": "assistant", "developer": "system", "function": "tool"}.get(role, role)
    text = "".join(b.text for b in m.blocks if isinstance(b, TextBlock))
    if role == "tool":
        return ChatMessage(
            "tool",
            text,
            name=m.additional_kwargs.get("name", "") or "",
            tool_call_id=m.additional_kwargs.get("tool_call_id", "") or "",
        )
    return ChatMessage(role, text, tool_calls=_tool_calls_of(m) if role == "assistant" else ())


def _message(text: str, calls: Sequence[ToolCall]) -> LIMessage:
    blocks: list[Any] = [TextBlock(text=text)] if text else []
    blocks += [ToolCallBlock(tool_call_id=c.id, tool_name=c.name, tool_kwargs=dict(c.arguments)) for c in calls]
    extra = (
        {
            "tool_calls": [
                {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": json.dumps(c.arguments)}}
                for c in calls
            ]
        }
        if calls
        else {}
    )
    return LIMessage(role=MessageRole.ASSISTANT, blocks=blocks, additional_kwargs=extra)


def _raw(r: TurnResult) -> dict[str, Any]:
    return {
        "session_id": r.session_id,
        "request_id": r.request_id,
        "turn_index": r.turn_index,
        "finish_reason": r.finish_reason,
        "replayed": r.replayed,
        "usage": r.usage.as_dict(),
        "token_ids": list(r.token_ids),
    }


class _StreamedChat:
    """A streamed turn's events as LlamaIndex's chat responses: the message so far with each text
    delta, tool calls gathered into it, the turn's result last (sync and asyncio streams share it)."""

    def __init__(self):
        self.text, self.calls = "", []

    def feed(self, event) -> ChatResponse | None:
        if isinstance(event, TextDelta):
            self.text += event.text
            return ChatResponse(message=_message(self.text, self.calls), delta=event.text)
        if isinstance(event, ToolCall):
            self.calls.append(event)
            return None
        return ChatResponse(message=_message(self.text, self.calls), delta="", raw=_raw(event))


class ChainKVLLM(FunctionCallingLLM):
    """A LlamaIndex chat LLM served by a chainkv sidecar over gRPC."""

    target: str = Field(default="127.0.0.1:50051", description="The sidecar's address.")
    session_id: str | None = Field(default=None, description="Conversation key: the sidecar session to continue.")
    model_config = ConfigDict(arbitrary_types_allowed=True, populate_by_name=True)

    token: SecretStr | None = Field(
        default=None,
        alias="api_key",
        exclude=True,
        description="Bearer token, when the sidecar has auth on (also ``api_key=``, OpenAILike's name); kept "
        "out of the repr and of to_dict/to_json.",
    )
    tls_ca: str | None = Field(default=None)
    timeout_s: float | None = Field(default=300.0, description="Deadline of one call, retries included.")
    max_retries: int = Field(default=3)
    max_tokens: int | None = Field(default=None, description="Tokens per reply (unset: the sidecar's default).")
    temperature: float | None = Field(default=None)
    top_k: int | None = Field(default=None)
    top_p: float | None = Field(default=None)
    seed: int | None = Field(default=None)
    stop: list[str] | None = Field(default=None)
    presence_penalty: float | None = Field(default=None, description="OpenAI's, in [-2, 2].")
    frequency_penalty: float | None = Field(default=None, description="OpenAI's, in [-2, 2].")
    repetition_penalty: float | None = Field(default=None, description="vLLM's, in [0.01, 100]; 1 is off.")
    method: str | None = Field(default=None, description="The session's sparse method (first turn).")
    budget: int | None = Field(default=None)
    budget_ratio: float | None = Field(default=None)
    method_args: dict[str, str] = Field(default_factory=dict)
    context_window: int | None = Field(default=None, description="Unset: the sidecar's max_model_len.")
    model_name: str | None = Field(default=None, description="Unset: the sidecar's model.")

    _conv: Conversations | None = PrivateAttr(default=None)
    _info: Any = PrivateAttr(default=None)

    @classmethod
    def class_name(cls) -> str:
        return "ChainKVLLM"

    @property
    def conversations(self) -> Conversations:
        if self._conv is None:
            self._conv = Conversations.from_settings(self)
        return self._conv

    @property
    def metadata(self) -> LLMMetadata:
        if (self.context_window is None or self.model_name is None or self.max_tokens is None) and self._info is None:
            self._info = self.conversations.client.server_info()
        info = self._info
        return LLMMetadata(
            context_window=self.context_window or info.max_model_len,
            num_output=self.max_tokens or info.default_max_tokens,
            is_chat_model=True,
            is_function_calling_model=True,
            model_name=self.model_name or info.model,
        )

    # --- plumbing --------------------------------------------------------------------------------------
    def _args(self, messages: Sequence[LIMessage], kwargs: dict[str, Any]):
        kwargs = dict(kwargs)
        key = kwargs.pop("session_id", self.session_id)
        tools: list[ToolSpec] = list(kwargs.pop("tools", None) or [])
        options = turn_options(self)
        options.update({k: v for k, v in kwargs.items() if k in options})
        return key, [to_chat_message(m) for m in messages], tools, options

    # --- chat ------------------------------------------------------------------------------------------
    @llm_chat_callback()
    def chat(self, messages: Sequence[LIMessage], **kwargs: Any) -> ChatResponse:
        key, msgs, tools, options = self._args(messages, kwargs)
        result = None
        for event in self.conversations.stream(key, msgs, tools, **options):
            if isinstance(event, TurnResult):
                result = event
        return ChatResponse(message=_message(result.text, result.tool_calls), raw=_raw(result))

    @llm_chat_callback()
    def stream_chat(self, messages: Sequence[LIMessage], **kwargs: Any) -> ChatResponseGen:
        key, msgs, tools, options = self._args(messages, kwargs)

        def gen() -> Generator[ChatResponse, None, None]:
            fold = _StreamedChat()
            for event in self.conversations.stream(key, msgs, tools, **options):
                if (response := fold.feed(event)) is not None:
                    yield response

        return gen()

    @llm_chat_callback()
    async def achat(self, messages: Sequence[LIMessage], **kwargs: Any) -> ChatResponse:
        key, msgs, tools, options = self._args(messages, kwargs)
        result = None
        async for event in self.conversations.astream(key, msgs, tools, **options):
            if isinstance(event, TurnResult):
                result = event
        return ChatResponse(message=_message(result.text, result.tool_calls), raw=_raw(result))

    @llm_chat_callback()
    async def astream_chat(self, messages: Sequence[LIMessage], **kwargs: Any) -> ChatResponseAsyncGen:
        key, msgs, tools, options = self._args(messages, kwargs)

        async def gen() -> AsyncGenerator[ChatResponse, None]:
            fold = _StreamedChat()
            async for event in self.conversations.astream(key, msgs, tools, **options):
                if (response := fold.feed(event)) is not None:
                    yield response

        return gen()

    # --- completion: one stateless user turn -------------------------------------------------------------
    @staticmethod
    def _prompt(prompt: str) -> list[LIMessage]:
        return [LIMessage(role=MessageRole.USER, content=prompt)]

    @staticmethod
    def _stateless(kwargs: dict[str, Any]) -> dict[str, Any]:
        return {"session_id": None, **kwargs}  # a completion continues no session unless asked to

    @llm_completion_callback()
    def complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        r = self.chat(self._prompt(prompt), **self._stateless(kwargs))
        return CompletionResponse(text=r.message.content or "", raw=r.raw)

    @llm_completion_callback()
    def stream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponseGen:
        def gen() -> Generator[CompletionResponse, None, None]:
            for r in self.stream_chat(self._prompt(prompt), **self._stateless(kwargs)):
                yield CompletionResponse(text=r.message.content or "", delta=r.delta, raw=r.raw)

        return gen()

    @llm_completion_callback()
    async def acomplete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        r = await self.achat(self._prompt(prompt), **self._stateless(kwargs))
        return CompletionResponse(text=r.message.content or "", raw=r.raw)

    @llm_completion_callback()
    async def astream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponseAsyncGen:
        async def gen() -> AsyncGenerator[CompletionResponse, None]:
            async for r in await self.astream_chat(self._prompt(prompt), **self._stateless(kwargs)):
                yield CompletionResponse(text=r.message.content or "", delta=r.delta, raw=r.raw)

        return gen()

    # --- function calling ----------------------------------------------------------------------------------
    def _prepare_chat_with_tools(
        self,
        tools: Sequence[Any],
        user_msg: str | LIMessage | None = None,
        chat_history: list[LIMessage] | None = None,
        verbose: bool = False,
        allow_parallel_tool_calls: bool = False,
        tool_required: bool = False,
        **kwargs: Any,
    ) -> dict[str, Any]:
        messages = list(chat_history or [])
        if user_msg is not None:
            messages.append(
                LIMessage(role=MessageRole.USER, content=user_msg) if isinstance(user_msg, str) else user_msg
            )
        specs = [as_tool(t.metadata.to_openai_tool()) for t in tools]
        choice = kwargs.pop("tool_choice", None)
        if choice is None and tool_required:
            choice = {"type": "function", "function": {"name": specs[0].name}} if len(specs) == 1 else "required"
        if choice is not None:
            kwargs["tool_choice"] = named_tool_choice(choice, [t.name for t in specs])
        return {"messages": messages, "tools": specs, **kwargs}

    def get_tool_calls_from_response(
        self, response: ChatResponse, error_on_no_tool_call: bool = True, **kwargs: Any
    ) -> list[ToolSelection]:
        calls = _tool_calls_of(response.message)
        if not calls and error_on_no_tool_call:
            raise ValueError(f"expected at least one tool call in the reply, got: {response.message.content!r}")
        return [ToolSelection(tool_id=c.id, tool_name=c.name, tool_kwargs=dict(c.arguments)) for c in calls]


__all__ = ["ChainKVLLM", "to_chat_message"]
