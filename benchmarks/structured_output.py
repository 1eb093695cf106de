"""Structured output under the grammar backend's settings, side by side on one engine.

    python benchmarks/structured_output.py [--model smollm2] [--out benchmarks/results/structured_output_cpu.json]

Two settings of ``GrammarBackend`` (engine/constrained.py) are compared, each from off to on:

* ``forced_whole_tokens``: where a grammar forces the next text (a JSON key with its quotes and colon,
  a tool call's ``<tool_call>`` frame), only the first token of xgrammar's longest-token split of that
  text is allowed; without it the mask lets the model spell forced text in any pieces;
* ``string_loop_window``: a JSON string whose last that many tokens already appeared in it is closed
  (engine/string_loop_guard.py; 0 is off).

Workloads, each run under every setting on the same prompts and seeds:

* ``json_schema``: the 20 prompts of tests/test_constrained.py under its review schema (greedy and
  sampled alternately, 160 tokens at most);
* ``joke_json_schema``: LangChain's ``with_structured_output(Joke, method="json_schema")`` with the
  server's defaults: the ``Joke`` schema as the reply's format, 12 prompts, greedy, 256 tokens at most
  (the sidecar's default ``max_tokens``), no penalty;
* ``forced_tool_call``: a forced call of LangChain's standard ``Joke`` tool (the schema whose forced
  call a 135M model failed to close within 64 tokens), 12 prompts, greedy, 64 tokens at most, with and
  without ``repetition_penalty=1.1``.

Reported per configuration: replies that completed their structure (finish ``stop``; each is
validated), the tokens generated, and the wall time. A reply that completes in fewer tokens spent
fewer decode steps; one that runs to ``max_tokens`` does not parse.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

JOKE = {
    "type": "object",
    "properties": {
        "setup": {"type": "string", "description": "question to set up a joke"},
        "punchline": {"type": "string", "description": "answer to resolve the joke"},
    },
    "required": ["setup", "punchline"],
}
JOKE_TOPICS = ["cats", "dogs", "programmers", "the sea", "coffee", "trains"]


def run(engine, prompts, params, check) -> tuple[dict, str]:
    """The replies' counts (complete structures, tokens, wall time) and the first reply's text."""
    t0 = time.perf_counter()
    outs = list(engine.generate(prompts, params))
    wall = time.perf_counter() - t0
    complete = 0
    for o in outs:
        if o.finish_reason == "stop":
            check(o.text)  # raises if a completed reply does not hold its structure
            complete += 1
    return {
        "replies": len(outs),
        "complete": complete,
        "tokens": sum(len(o.token_ids) for o in outs),
        "wall_s": round(wall, 2),
    }, outs[0].text[:200]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/structured_output_cpu.json"))
    ap.add_argument("--workloads", default="json_schema,joke_json_schema,forced_tool_call", help="which to run")
    ap.add_argument(
        "--settings",
        default="0:0,1:0,1:8",
        help="forced_whole_tokens (0/1):string_loop_window pairs to run, comma-separated",
    )
    ap.add_argument(
        "--keep",
        action="store_true",
        help="keep the rows of the existing --out file that this run does not measure again (each row says "
        "its settings; wall times of rows from different runs compare only on an equally loaded machine)",
    )
    args = ap.parse_args()
    workloads = set(args.workloads.split(","))
    settings = [(bool(int(f)), int(w)) for f, w in (pair.split(":") for pair in args.settings.split(","))]

    import jsonschema

    import test_constrained as cases
    from engine.config import EngineConfig
    from engine.constrained import STRING_LOOP_WINDOW, Constraint
    from engine.llm import LLMEngine
    from engine.sampling import SamplingParams
    from sidecar.turns.chat import ChatRenderer, ToolSpec
    from sidecar.turns.structured import tool_call_constraint
    from sidecar.turns.tool_calls import ToolCallParser

    engine = LLMEngine(EngineConfig(model=args.model, num_pages=20000, prefill_chunk_size=128))
    review = Constraint.json_schema(cases.REVIEW)
    json_prompts = [
        engine.apply_chat_template([{"role": "user", "content": p + " Answer in JSON."}]) for p in cases.PROMPTS
    ]

    def json_params():
        return [
            SamplingParams(max_tokens=160, temperature=0.0 if i % 2 else 0.7, seed=i, constraint=review)
            for i in range(len(json_prompts))
        ]

    def check_review(text: str) -> None:
        jsonschema.validate(json.loads(text), cases.REVIEW)

    joke = ToolSpec("Joke", "Joke to tell user.", JOKE)
    renderer = ChatRenderer(engine.tokenizer, engine.eos_token_ids)
    questions = [f"Tell me a joke about {t}." for t in JOKE_TOPICS] + list(cases.PROMPTS[:6])
    tool_prompts = [renderer.first_turn([{"role": "user", "content": q}], [joke]).token_ids for q in questions]
    forced = tool_call_constraint([joke])

    def check_call(text: str) -> None:
        parser = ToolCallParser([joke.name])
        calls = [v for k, v in parser.feed(text) + parser.finish() if k == "tool_call"]
        assert len(calls) == 1, text
        jsonschema.validate(json.loads(calls[0].arguments_json), JOKE)

    joke_format = Constraint.json_schema(JOKE)
    joke_prompts = [engine.apply_chat_template([{"role": "user", "content": q}]) for q in questions]

    def check_joke(text: str) -> None:
        jsonschema.validate(json.loads(text), JOKE)

    rows, examples = [], {}
    for forced_whole_tokens, window in settings:
        engine.grammars.forced_whole_tokens = forced_whole_tokens
        engine.grammars.string_loop_window = window
        configs = [("json_schema", None, json_prompts, json_params(), check_review)]
        joke_params = [SamplingParams(max_tokens=256, constraint=joke_format) for _ in joke_prompts]
        configs.append(("joke_json_schema", None, joke_prompts, joke_params, check_joke))
        for penalty in (None, 1.1):
            extra = {"repetition_penalty": penalty} if penalty else {}
            params = [SamplingParams(max_tokens=64, constraint=forced, **extra) for _ in tool_prompts]
            configs.append(("forced_tool_call", penalty, tool_prompts, params, check_call))
        for workload, penalty, prompts, params, check in configs:
            if workload not in workloads:
                continue
            row, first = run(engine, prompts, params, check)
            setting = {"forced_whole_tokens": forced_whole_tokens, "string_loop_window": window}
            rows.append({"workload": workload, "repetition_penalty": penalty, **setting, **row})
            examples[f"{workload} penalty={penalty} forced_whole_tokens={forced_whole_tokens} window={window}"] = first
            print(
                f"{workload} penalty={penalty} forced_whole_tokens={forced_whole_tokens} window={window}: "
                f"{row['complete']}/{row['replies']} complete, {row['tokens']} tokens, {row['wall_s']} s",
                flush=True,
            )
    if args.keep and Path(args.out).exists():
        old = json.loads(Path(args.out).read_text())

        def key(r: dict) -> tuple:
            return (
                r["workload"],
                r["repetition_penalty"],
                r["forced_whole_tokens"],
                r.get("string_loop_window", 0),
            )

        measured = {key(r) for r in rows}
        kept = [
            dict(r, string_loop_window=r.get("string_loop_window", 0)) for r in old["rows"] if key(r) not in measured
        ]
        rows = sorted(kept + rows, key=lambda r: (r["forced_whole_tokens"], r["string_loop_window"]))
        examples = {**old.get("first_replies", {}), **examples}
    result = {
        "description": "Structured output on "
        + engine.model_dir.name
        + f" ({engine.device}): replies that completed their structure (validated), tokens generated and wall "
        "time, without and with forced text in whole vocabulary tokens (forced_whole_tokens), then with JSON "
        f"strings that repeat a run of {STRING_LOOP_WINDOW} tokens closed (string_loop_window; both are the "
        "defaults), on the same prompts and seeds (`python benchmarks/structured_output.py`). "
        "joke_json_schema is LangChain's with_structured_output(Joke, method='json_schema') with the "
        "server's defaults (greedy, 256 tokens, no penalty).",
        "model": str(engine.model_dir.name),
        "device": str(engine.device),
        "rows": rows,
        "first_replies": examples,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
