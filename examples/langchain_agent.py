"""A LangChain tool-calling agent loop on a chainkv sidecar.

    chainkv serve --port 50051 &            # SmolLM2 on this machine
    python examples/langchain_agent.py --target 127.0.0.1:50051

The model (``ChatChainKV``) gets two tools. Each question runs the usual agent loop: invoke the
model with the whole conversation; while its reply carries ``tool_calls``, run them and append
``ToolMessage``s; stop at a reply without calls. The conversation is one LangGraph-style thread
(``configurable.thread_id``), so the sidecar keeps its KV between calls and each call sends only
the new messages: the printed ``reused`` count is the cached context the turn did not recompute.
SmolLM2-135M often answers without calling a tool; larger models call them. The same model
object works as the model of a LangGraph agent (``create_react_agent(llm, tools)``).
"""

from __future__ import annotations

import argparse
import datetime
import uuid

from langchain_core.messages import BaseMessage, HumanMessage, SystemMessage
from langchain_core.tools import tool

from agent_adapters.langchain import ChatChainKV
from sidecar.cli.demo import calculate  # the sidecar demo's calculator: arithmetic on the syntax tree, no eval()


@tool
def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression (+ - * / // % ** and parentheses), e.g. '12 * (3 + 4)'."""
    return calculate(expression)


@tool
def clock() -> str:
    """The current local date and time."""
    return datetime.datetime.now().strftime("%A %d %B %Y, %H:%M")


TOOLS = {t.name: t for t in (calculator, clock)}
QUESTIONS = ["What is 37 * 41? Use the calculator.", "What time is it?", "Thanks! Summarize our chat in one sentence."]


def run(
    target: str,
    questions: list[str] = QUESTIONS,
    max_tokens: int = 96,
    max_hops: int = 3,
    thread_id: str | None = None,
    out=print,
) -> list[BaseMessage]:
    llm = ChatChainKV(target=target, max_tokens=max_tokens).bind_tools(list(TOOLS.values()))
    config = {"configurable": {"thread_id": thread_id or f"lc-agent-{uuid.uuid4().hex[:8]}"}}
    history: list[BaseMessage] = [SystemMessage("You are a helpful assistant. Call a tool when it helps.")]
    for q in questions:
        out(f"user: {q}")
        history.append(HumanMessage(q))
        for _ in range(max_hops + 1):
            reply = llm.invoke(history, config=config)
            history.append(reply)
            u = reply.response_metadata["chainkv_usage"]
            out(
                f"assistant: {reply.content}  [turn {reply.response_metadata['turn_index']}: "
                f"{u['prompt_tokens']} new tokens, {u['reused_tokens']} reused]"
            )
            if not reply.tool_calls:
                break
            for call in reply.tool_calls:
                result = TOOLS[call["name"]].invoke(call) if call["name"] in TOOLS else None
                if result is None:
                    continue
                out(f"  tool {call['name']}({call['args']}) -> {result.content}")
                history.append(result)
    return history


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="127.0.0.1:50051")
    ap.add_argument("--max-tokens", type=int, default=96)
    args = ap.parse_args()
    run(args.target, max_tokens=args.max_tokens)


if __name__ == "__main__":
    main()
