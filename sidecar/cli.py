"""The ``chainkv`` command.

    chainkv generate [--model M] [--method NAME] [--budget N] [--max-tokens N] [--chat] [--json] PROMPT
"""

from __future__ import annotations

import argparse
import json
import logging
import sys

from engine.config import ConfigError
from sidecar.engine_args import add_engine_args, engine_config_from_args


def _methods_epilog() -> str:
    from engine.methods import describe

    return "sparse methods (--method NAME, parameters as --method-arg KEY=VALUE):\n" + describe()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="chainkv", description="chainkv: a sparse-first inference engine and agent sidecar")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text for one prompt",
                         formatter_class=argparse.RawDescriptionHelpFormatter, epilog=_methods_epilog())
    gen.add_argument("prompt", help="the prompt text ('-' reads standard input)")
    gen.add_argument("--chat", action="store_true", help="apply the model's chat template to PROMPT as one user message")
    gen.add_argument("--system", default=None, help="with --chat: a system message")
    gen.add_argument("--json", action="store_true", help="print one JSON object (token_ids, text, finish_reason, usage)")
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--stop", action="append", default=[], help="a stop string (repeatable)")
    gen.add_argument("--ignore-eos", action="store_true")
    add_engine_args(gen)
    return parser


def cmd_generate(args: argparse.Namespace) -> int:
    from engine.llm import LLMEngine, RequestError
    from engine.sampling import SamplingError, SamplingParams

    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    try:
        config = engine_config_from_args(args)
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                                top_p=args.top_p, seed=config.seed, stop=args.stop, ignore_eos=args.ignore_eos)
    except (ConfigError, SamplingError) as e:
        print(f"chainkv: {e}", file=sys.stderr)
        return 2
    engine = LLMEngine(config)
    try:
        if args.chat:
            messages = ([{"role": "system", "content": args.system}] if args.system else []) + [{"role": "user", "content": prompt}]
            tokens = engine.apply_chat_template(messages)
        else:
            tokens = engine.encode(prompt)
        rid = engine.add_request(tokens, params)
    except (RequestError, ValueError) as e:
        print(f"chainkv: {e}", file=sys.stderr)
        return 2
    final = None
    while final is None:
        for out in engine.step():
            if out.request_id != rid:
                continue
            if not args.json and out.new_text:
                print(out.new_text, end="", flush=True)
            if out.finished:
                final = out
    if final.finish_reason == "error":
        print(f"chainkv: {final.error}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps({
            "token_ids": final.token_ids,
            "text": final.text,
            "finish_reason": final.finish_reason,
            "usage": {"prompt_tokens": len(tokens), "generated_tokens": len(final.token_ids),
                      "time_to_first_token_s": final.time_to_first_token},
            "method": config.method,
        }))
    else:
        print()
    return 0


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    from engine.lifecycle import MethodError
    from engine.model.loader import ModelLoadError

    try:
        if args.command == "generate":
            return cmd_generate(args)
    except (ConfigError, MethodError, ModelLoadError) as e:
        print(f"chainkv: {e}", file=sys.stderr)
        return 2
    return 2


if __name__ == "__main__":
    sys.exit(main())
