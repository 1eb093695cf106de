"""The ``chainkv`` command.

chainkv serve [ENGINE FLAGS] [--port 50051] [--store redis://...|file://...|none] [--auth-token T=TENANT]
chainkv demo [--target 127.0.0.1:50051]
chainkv generate [--model M] [--method NAME] [--budget N] [--max-tokens N] [--chat] [--json] PROMPT
chainkv calibrate duo_attention [--model M] [--samples N] [--out FILE]

This module dispatches (``main``, the console script) and runs generate, calibrate and demo; the
parser and every flag are in ``sidecar.cli.args``, the serve command in ``sidecar.cli.serve``.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys

from engine.config import ConfigError
from sidecar.cli.args import build_parser
from sidecar.cli.engine_args import engine_config_from_args
from sidecar.cli.serve import cmd_serve


def cmd_demo(args: argparse.Namespace) -> int:
    from sidecar.cli.demo import run_demo

    return run_demo(args.target, args.session, args.max_tokens, args.token, args.tls_ca)


def cmd_generate(args: argparse.Namespace) -> int:
    from engine.api import LLMEngine, RequestError, SamplingError, SamplingParams

    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    if not prompt.strip():
        print("chainkv: the prompt is empty", file=sys.stderr)
        return 2
    try:
        config = engine_config_from_args(args)
        params = SamplingParams(
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_k=args.top_k,
            top_p=args.top_p,
            seed=config.seed,
            stop=args.stop,
            ignore_eos=args.ignore_eos,
            presence_penalty=args.presence_penalty,
            frequency_penalty=args.frequency_penalty,
            repetition_penalty=args.repetition_penalty,
        )
    except (ConfigError, SamplingError) as e:
        print(f"chainkv: {e}", file=sys.stderr)
        return 2
    engine = LLMEngine(config)
    try:
        if args.chat:
            messages = ([{"role": "system", "content": args.system}] if args.system else []) + [
                {"role": "user", "content": prompt}
            ]
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
    if final.finish_reason in ("error", "failed"):
        print(f"chainkv: {final.error}", file=sys.stderr)
        return 1
    if args.json:
        print(
            json.dumps(
                {
                    "token_ids": final.token_ids,
                    "text": final.text,
                    "finish_reason": final.finish_reason,
                    "usage": {
                        "prompt_tokens": len(tokens),
                        "generated_tokens": len(final.token_ids),
                        "time_to_first_token_s": final.time_to_first_token,
                        "evicted_tokens": engine.stats().evicted_tokens,
                    },
                    "method": config.method,
                }
            )
        )
    else:
        print()
    return 0


def cmd_calibrate(args: argparse.Namespace) -> int:
    from engine.api import LLMEngine, calibrate_duo, write_duo_pattern

    if args.samples < 1 or not 0 < args.min_tokens <= args.max_tokens:
        print("chainkv: --samples must be >= 1 and 0 < --min-tokens <= --max-tokens", file=sys.stderr)
        return 2
    engine = LLMEngine(engine_config_from_args(args), num_pages=1)
    pattern = calibrate_duo(
        engine,
        samples=args.samples,
        min_tokens=args.min_tokens,
        max_tokens=args.max_tokens,
        n_sink=args.n_sink,
        n_recent=args.n_recent,
        seed=args.calibration_seed,
    )
    path = write_duo_pattern(pattern, args.out or f"duo_pattern_{pattern['model']}.json")
    cal = pattern["calibration"]
    print(
        f"wrote {path}: {pattern['num_layers']} layers x {pattern['num_kv_heads']} kv-heads, "
        f"{cal['answered']}/{cal['samples']} passkeys answered"
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    from engine.api import MethodError, ModelLoadError

    try:
        if args.command == "generate":
            return cmd_generate(args)
        if args.command == "serve":
            return cmd_serve(args)
        if args.command == "demo":
            return cmd_demo(args)
        if args.command == "calibrate":
            return cmd_calibrate(args)
    except (ConfigError, MethodError, ModelLoadError) as e:
        print(f"chainkv: {e}", file=sys.stderr)
        return 2
    return 2


if __name__ == "__main__":
    sys.exit(main())
