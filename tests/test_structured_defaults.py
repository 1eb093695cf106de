"""Structured output that parses with the sidecar's default settings on SmolLM2-135M (issue 30): greedy,
the default ``max_tokens``, no repetition penalty, through the clients a user reaches for first.

SmolLM2-135M, greedy and unpenalized, loops inside a free JSON string ("A cat is a cat, a cat is a
cat, ...") and never closes it; the grammar backend closes a string once it repeats itself
(engine/string_loop_guard.py), so each of these replies completes its structure and parses:

* LangChain ``ChatOpenAI(...).with_structured_output(Joke, method="json_schema")`` against the HTTP front
  (the README's example), on Chat Completions and on the Responses API;
* the ``openai`` client's ``chat.completions.parse`` and ``responses.parse``;
* over gRPC, LangChain ``ChatChainKV.with_structured_output`` and LlamaIndex ``ChainKVLLM.structured_predict``
  (a forced tool call).
"""

from __future__ import annotations

import pytest

pytest.importorskip("langchain_openai")
pytest.importorskip("llama_index.core")

from pydantic import BaseModel, Field  # noqa: E402

ASK = "Tell me a joke about cats."


class Joke(BaseModel):
    """Joke to tell user."""

    setup: str = Field(description="question to set up a joke")
    punchline: str = Field(description="answer to resolve the joke")


class _Live:
    grpc: str = ""
    http: str = ""
    model: str = ""


@pytest.fixture(scope="module")
def live(smol_engine):
    from sidecar.http.app import HttpFront, HttpOptions
    from sidecar.grpc.server import ServerOptions, ServerThread

    thread = ServerThread(smol_engine, ServerOptions(port=0))
    port = thread.start()
    http = HttpFront(thread.server, HttpOptions(port=0))
    http_port = thread.run(http.start())
    _Live.grpc, _Live.http = f"127.0.0.1:{port}", f"http://127.0.0.1:{http_port}/v1"
    _Live.model = http.app.state.backend.model_name
    yield _Live
    thread.run(http.stop())
    thread.stop(grace=2)
    for sid in list(smol_engine.chains.chains):
        smol_engine.end_session(sid)


def _parsed(joke) -> None:
    assert isinstance(joke, Joke) and joke.setup and joke.punchline


@pytest.mark.parametrize("responses_api", [False, True])
def test_langchain_chat_openai_json_schema_with_defaults(live, responses_api):
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(
        base_url=live.http, api_key="none", model=live.model, max_retries=0, use_responses_api=responses_api
    )
    _parsed(llm.with_structured_output(Joke, method="json_schema").invoke(ASK))


def test_openai_client_parse_with_defaults(live):
    import openai

    client = openai.OpenAI(base_url=live.http, api_key="none", max_retries=0, timeout=300)
    chat = client.chat.completions.parse(
        model=live.model, messages=[{"role": "user", "content": ASK}], response_format=Joke
    )
    _parsed(chat.choices[0].message.parsed)
    _parsed(client.responses.parse(model=live.model, input=ASK, text_format=Joke).output_parsed)


def test_grpc_adapters_structured_output_with_defaults(live):
    from llama_index.core.prompts import PromptTemplate

    from agent_adapters.langchain import ChatChainKV
    from agent_adapters.llamaindex import ChainKVLLM

    _parsed(ChatChainKV(target=live.grpc).with_structured_output(Joke).invoke(ASK))
    llm = ChainKVLLM(target=live.grpc)
    _parsed(llm.structured_predict(Joke, PromptTemplate("Tell me a joke about {topic}."), topic="cats"))
