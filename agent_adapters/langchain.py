"""LangChain chat model backed by the chainkv sidecar: ``ChatChainKV``.

    from agent_adapters.langchain import ChatChainKV

    llm = ChatChainKV(target="127.0.0.1:50051", max_tokens=128).bind_tools([get_weather])
    llm.invoke(messages, config={"configurable": {"thread_id": "run-42"}})

Sessions. The conversation key is, first found: ``session_id`` passed to invoke/stream, the
model's ``session_id`` field, the RunnableConfig's ``configurable.thread_id`` (LangGraph's
thread), then ``thread_id`` in the run metadata. Calls of one key continue one sidecar session and
send only the messages it has not seen (``agent_adapters.ledger``); a call without any key is
stateless (a throwaway session). Tools bound with ``bind_tools`` are sent on the session's first
turn (the sidecar fixes a session's tools there); the replies' tool calls come back as
``AIMessage.tool_calls`` (and as ``tool_call_chunks`` while streaming). ``bind_tools(tool_choice=...)``
forces a call and ``with_structured_output`` (function_calling, json_schema, json_mode) constrains the
reply, both by grammar-constrained decoding on the sidecar (``TurnRequest.tool_choice`` /
``response_format``).

Usage: ``usage_metadata`` counts the context the turn ran on (``input_tokens``, with the cached
part as ``input_token_details.cache_read``) and the tokens generated; ``response_metadata``
carries the sidecar's own counters (prefilled, reused, pruned, time to first token, tier).
"""

from __future__ import annotations

import json
from operator import itemgetter
from typing import Any, AsyncIterator, Callable, Iterator, Sequence

from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.language_models import LanguageModelInput
from langchain_core.language_models.chat_models import BaseChatModel
from langchain_core.messages import (
    AIMessage,
    AIMessageChunk,
    BaseMessage,
    ChatMessage as LCChatMessage,
    HumanMessage,
    SystemMessage,
    ToolMessage,
)
from langchain_core.messages.tool import tool_call_chunk
from langchain_core.output_parsers import JsonOutputParser, PydanticOutputParser
from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, ChatResult
from langchain_core.runnables import Runnable, RunnableConfig, RunnableMap, RunnablePassthrough
from langchain_core.runnables.config import ensure_config
from langchain_core.tools import BaseTool
from langchain_core.utils.function_calling import convert_to_openai_tool
from langchain_core.utils.pydantic import is_basemodel_subclass
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, SecretStr

from agent_adapters.conversation import Conversations, turn_options
from agent_adapters.messages import ChatMessage, TextDelta, ToolCall, ToolSpec, TurnResult, as_tool
from agent_adapters.output_format import named_tool_choice


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    parts = []
    for block in content or []:
        if isinstance(block, str):
            parts.append(block)
        elif isinstance(block, dict) and block.get("type") == "text":
            parts.append(block.get("text", ""))
    return "".join(parts)


def to_chat_message(m: BaseMessage) -> ChatMessage:
    if isinstance(m, LCChatMessage):
        role = {"human": "user", "ai": "assistant"}.get(m.role, m.role)
    elif isinstance(m, HumanMessage):
        role = "user"
    elif isinstance(m, AIMessage):  # AIMessageChunk too
        role = "assistant"
    elif isinstance(m, SystemMessage):
        role = "system"
    elif isinstance(m, ToolMessage):
        role = "tool"
    else:
        raise ValueError(f"chainkv cannot send a {type(m).__name__}; use system, human, ai or tool messages")
    if isinstance(m, ToolMessage):
        return ChatMessage("tool", _text(m.content), name=m.name or "", tool_call_id=m.tool_call_id or "")
    calls = tuple(
        ToolCall(c.get("id") or "", c["name"], dict(c.get("args") or {})) for c in getattr(m, "tool_calls", None) or []
    )
    return ChatMessage(role, _text(m.content), tool_calls=calls)


def _usage_metadata(r: TurnResult) -> dict[str, Any]:
    u = r.usage
    context = max(0, u.history_tokens - u.generated_tokens)
    return {
        "input_tokens": context,
        "output_tokens": u.generated_tokens,
        "total_tokens": context + u.generated_tokens,
        "input_token_details": {"cache_read": u.reused_tokens},
    }


def _response_metadata(r: TurnResult, model: str) -> dict[str, Any]:
    return {
        "finish_reason": r.finish_reason,
        "model_name": model,
        "session_id": r.session_id,
        "request_id": r.request_id,
        "turn_index": r.turn_index,
        "replayed": r.replayed,
        "chainkv_usage": r.usage.as_dict(),
        "token_ids": list(r.token_ids),
    }


def _lc_tool_calls(calls: Sequence[ToolCall]) -> list[dict[str, Any]]:
    return [{"name": c.name, "args": dict(c.arguments), "id": c.id, "type": "tool_call"} for c in calls]


class ChatChainKV(BaseChatModel):
    """A LangChain chat model served by a chainkv sidecar over gRPC."""

    model_config = ConfigDict(arbitrary_types_allowed=True, populate_by_name=True)

    target: str = "127.0.0.1:50051"
    """The sidecar's address."""
    session_id: str | None = None
    """A fixed conversation key; unset: taken per call (see the module docstring)."""
    token: SecretStr | None = Field(default=None, alias="api_key")
    """Bearer token, when the sidecar has auth on (also ``api_key=``, LangChain's name, at construction);
    a SecretStr, so it stays out of the model's repr."""
    tls_ca: str | None = None
    timeout_s: float | None = Field(default=300.0, alias="timeout")
    """Deadline of one call in seconds, retries included (also ``timeout=``, LangChain's name, at
    construction or per call)."""
    max_retries: int = 3
    model_name: str = "chainkv"
    # sampling (the sidecar's SamplingParams names)
    max_tokens: int | None = None
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: list[str] | None = None
    presence_penalty: float | None = None
    """OpenAI's, in [-2, 2]: lowers every token the reply already contains."""
    frequency_penalty: float | None = None
    """OpenAI's, in [-2, 2]: lowers a token once per time the reply contains it."""
    repetition_penalty: float | None = None
    """vLLM's, in [0.01, 100] (1 is off): divides the positive logits of tokens in the prompt or reply."""
    # the session's sparse method (first turn only)
    method: str | None = None
    budget: int | None = None
    budget_ratio: float | None = None
    method_args: dict[str, str] = Field(default_factory=dict)

    _conv: Conversations | None = PrivateAttr(default=None)

    @property
    def conversations(self) -> Conversations:
        if self._conv is None:
            self._conv = Conversations.from_settings(self)
        return self._conv

    @property
    def _llm_type(self) -> str:
        return "chainkv"

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return {
            "target": self.target,
            "model_name": self.model_name,
            "method": self.method,
            "budget": self.budget,
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
        }

    # --- tools -------------------------------------------------------------------------------------------
    def bind_tools(
        self,
        tools: Sequence[dict[str, Any] | type | Callable[..., Any] | BaseTool],
        *,
        tool_choice: str | bool | dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> Runnable[LanguageModelInput, AIMessage]:
        """Bind tools; ``tool_choice``: None or "auto" (the model decides), "none", "required" (or
        "any", True: one call to one of the tools), a tool's name or ``{"type": "function",
        "function": {"name": ...}}`` (one call to that tool). A forced call is decoded under a grammar,
        so its arguments validate against the tool's schema."""
        specs = [as_tool(convert_to_openai_tool(t)) for t in tools]
        if tool_choice is not None:
            kwargs["tool_choice"] = named_tool_choice(tool_choice, [t.name for t in specs])
        return super().bind(tools=specs, **kwargs)

    def with_structured_output(
        self,
        schema: dict[str, Any] | type,
        *,
        include_raw: bool = False,
        method: str = "json_schema",
        strict: bool | None = None,
        **kwargs: Any,
    ) -> Runnable[LanguageModelInput, dict | BaseModel]:
        """Replies parsed into ``schema`` (a pydantic class, a TypedDict, a JSON Schema or an OpenAI
        tool dict). ``method``: "json_schema" (the default, as langchain-openai's: the reply itself is
        JSON under the schema, through ``response_format``), "function_calling" (one forced call to a
        tool of that schema) or "json_mode" (any JSON object; parsed into ``schema`` when it is a
        pydantic class). Each is decoded under a grammar, so the output parses."""
        if kwargs:
            raise ValueError(f"Received unsupported arguments {kwargs}")
        if method == "function_calling":
            return super().with_structured_output(schema, include_raw=include_raw)
        if method not in ("json_schema", "json_mode"):
            raise ValueError(f"method must be function_calling, json_schema or json_mode, not {method!r}")
        pydantic_cls = schema if isinstance(schema, type) and is_basemodel_subclass(schema) else None
        if method == "json_mode":
            fmt: dict[str, Any] = {"type": "json_object"}
        else:
            fn = convert_to_openai_tool(schema)["function"]
            fmt = {"type": "json_schema", "json_schema": {"name": fn["name"], "schema": fn.get("parameters") or {}}}
        llm = self.bind(
            response_format=fmt, ls_structured_output_format={"kwargs": {"method": method}, "schema": schema}
        )
        parser = PydanticOutputParser(pydantic_object=pydantic_cls) if pydantic_cls else JsonOutputParser()
        if not include_raw:
            return llm | parser
        parsed = RunnablePassthrough.assign(parsed=itemgetter("raw") | parser, parsing_error=lambda _: None)
        fallback = RunnablePassthrough.assign(parsed=lambda _: None)
        return RunnableMap(raw=llm) | parsed.with_fallbacks([fallback], exception_key="parsing_error")

    # --- the session key ------------------------------------------------------------------------------
    def _with_key(self, config: RunnableConfig | None, kwargs: dict[str, Any]) -> dict[str, Any]:
        if "session_id" not in kwargs and self.session_id is None:
            thread = ((config or {}).get("configurable") or {}).get("thread_id")
            if thread is not None:
                kwargs["session_id"] = str(thread)
        return kwargs

    def invoke(
        self,
        input: LanguageModelInput,
        config: RunnableConfig | None = None,
        *,
        stop: list[str] | None = None,
        **kwargs: Any,
    ) -> AIMessage:
        return super().invoke(input, config, stop=stop, **self._with_key(config, kwargs))

    async def ainvoke(
        self,
        input: LanguageModelInput,
        config: RunnableConfig | None = None,
        *,
        stop: list[str] | None = None,
        **kwargs: Any,
    ) -> AIMessage:
        return await super().ainvoke(input, config, stop=stop, **self._with_key(config, kwargs))

    def stream(
        self,
        input: LanguageModelInput,
        config: RunnableConfig | None = None,
        *,
        stop: list[str] | None = None,
        **kwargs: Any,
    ) -> Iterator[AIMessageChunk]:
        return super().stream(input, config, stop=stop, **self._with_key(config, kwargs))

    def astream(
        self,
        input: LanguageModelInput,
        config: RunnableConfig | None = None,
        *,
        stop: list[str] | None = None,
        **kwargs: Any,
    ) -> AsyncIterator[AIMessageChunk]:
        return super().astream(input, config, stop=stop, **self._with_key(config, kwargs))

    def _key(self, kwargs: dict[str, Any], run_manager) -> str | None:
        key = kwargs.pop("session_id", None) or self.session_id
        if key is None:
            key = (ensure_config().get("configurable") or {}).get("thread_id")
        if key is None and run_manager is not None:
            key = (getattr(run_manager, "metadata", None) or {}).get("thread_id")
        return None if key is None else str(key)

    def _call_args(self, messages: list[BaseMessage], stop: list[str] | None, kwargs: dict[str, Any], run_manager):
        kwargs = dict(kwargs)
        key = self._key(kwargs, run_manager)
        tools: list[ToolSpec] = list(kwargs.pop("tools", []) or [])
        options = turn_options(self, stop=stop if stop is not None else self.stop, timeout_s=None)
        if "timeout" in kwargs:
            kwargs["timeout_s"] = kwargs.pop("timeout")
        options.update({k: v for k, v in kwargs.items() if k in options})
        return key, [to_chat_message(m) for m in messages], tools, options

    # --- generation ----------------------------------------------------------------------------------
    def _result(self, r: TurnResult) -> ChatResult:
        msg = AIMessage(
            content=r.text,
            tool_calls=_lc_tool_calls(r.tool_calls),
            usage_metadata=_usage_metadata(r),
            response_metadata=_response_metadata(r, self.model_name),
        )
        return ChatResult(generations=[ChatGeneration(message=msg)])

    def _chunk(self, event, k: int) -> ChatGenerationChunk:
        if isinstance(event, TextDelta):
            return ChatGenerationChunk(message=AIMessageChunk(content=event.text))
        if isinstance(event, ToolCall):
            return ChatGenerationChunk(
                message=AIMessageChunk(
                    content="",
                    tool_call_chunks=[
                        tool_call_chunk(name=event.name, args=json.dumps(event.arguments), id=event.id, index=k)
                    ],
                )
            )
        return ChatGenerationChunk(
            message=AIMessageChunk(
                content="",
                usage_metadata=_usage_metadata(event),
                chunk_position="last",
                response_metadata=_response_metadata(event, self.model_name),
            ),
            generation_info={"finish_reason": event.finish_reason},
        )

    def _generate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        key, msgs, tools, options = self._call_args(messages, stop, kwargs, run_manager)
        result = None
        for event in self.conversations.stream(key, msgs, tools, **options):
            if isinstance(event, TurnResult):
                result = event
            elif isinstance(event, TextDelta) and run_manager is not None and event.text:
                run_manager.on_llm_new_token(event.text)
        return self._result(result)

    def _stream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> Iterator[ChatGenerationChunk]:
        key, msgs, tools, options = self._call_args(messages, stop, kwargs, run_manager)
        calls = 0
        for event in self.conversations.stream(key, msgs, tools, **options):
            chunk = self._chunk(event, calls)
            calls += isinstance(event, ToolCall)
            if run_manager is not None:
                run_manager.on_llm_new_token(chunk.text, chunk=chunk)
            yield chunk

    async def _agenerate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        key, msgs, tools, options = self._call_args(messages, stop, kwargs, run_manager)
        result = None
        async for event in self.conversations.astream(key, msgs, tools, **options):
            if isinstance(event, TurnResult):
                result = event
            elif isinstance(event, TextDelta) and run_manager is not None and event.text:
                await run_manager.on_llm_new_token(event.text)
        return self._result(result)

    async def _astream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> AsyncIterator[ChatGenerationChunk]:
        key, msgs, tools, options = self._call_args(messages, stop, kwargs, run_manager)
        calls = 0
        async for event in self.conversations.astream(key, msgs, tools, **options):
            chunk = self._chunk(event, calls)
            calls += isinstance(event, ToolCall)
            if run_manager is not None:
                await run_manager.on_llm_new_token(chunk.text, chunk=chunk)
            yield chunk


__all__ = ["ChatChainKV", "to_chat_message"]
