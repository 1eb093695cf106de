"""A LlamaIndex chat engine on a chainkv sidecar.

    chainkv serve --port 50051 &            # SmolLM2 on this machine
    python examples/llamaindex_chat.py --target 127.0.0.1:50051

``SimpleChatEngine`` keeps the conversation in its memory and hands the LLM the whole history on
every message; ``ChainKVLLM`` (with a ``session_id``) sends the sidecar only what the session has
not seen, so each reply starts from the cached KV of the conversation so far. Replies stream.
The memory counts tokens with a whitespace split here: LlamaIndex's default counter downloads a
tiktoken table, which an offline machine does not have.
"""

from __future__ import annotations

import argparse
import uuid

from llama_index.core.chat_engine import SimpleChatEngine
from llama_index.core.memory import ChatMemoryBuffer

from agent_adapters.llamaindex import ChainKVLLM

QUESTIONS = ["Hi! Suggest a name for a grey cat.", "Why that name?", "Give me one more option."]


def run(
    target: str, questions: list[str] = QUESTIONS, max_tokens: int = 64, session_id: str | None = None, out=print
) -> ChainKVLLM:
    llm = ChainKVLLM(target=target, session_id=session_id or f"li-chat-{uuid.uuid4().hex[:8]}", max_tokens=max_tokens)
    meta = llm.metadata
    out(f"model {meta.model_name}, context window {meta.context_window} tokens")
    memory = ChatMemoryBuffer.from_defaults(token_limit=meta.context_window - max_tokens, tokenizer_fn=str.split)
    engine = SimpleChatEngine.from_defaults(
        llm=llm, memory=memory, system_prompt="You are a friendly, concise assistant."
    )
    for q in questions:
        out(f"user: {q}")
        reply = engine.stream_chat(q)
        out("assistant: " + "".join(reply.response_gen))
        s = llm.conversations.client.get_session(llm.session_id)
        out(f"  [session {s.session_id}: {s.turn_index} turns, {s.history_tokens} tokens cached]")
    return llm


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="127.0.0.1:50051")
    ap.add_argument("--max-tokens", type=int, default=64)
    args = ap.parse_args()
    run(args.target, max_tokens=args.max_tokens)


if __name__ == "__main__":
    main()
