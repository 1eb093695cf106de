"""The ``chainkv`` command line: its parser, every subcommand's flags (generate, serve, calibrate, demo).

The engine flags every model-loading command shares come from ``sidecar.cli.engine_args`` (one per
EngineConfig field); ``chainkv serve``'s server flags come from ``ServerOptions`` (one per field,
sidecar/grpc/options.py), which are also read from the environment and the YAML file
(``sidecar.cli.serve_config``).
"""

from __future__ import annotations

import argparse

from sidecar.cli.engine_args import add_engine_args
from sidecar.grpc.options import ServerOptions
from sidecar.settings import add_flags


def _methods_epilog() -> str:
    from engine.api import describe_methods

    return "sparse methods (--method NAME, parameters as --method-arg KEY=VALUE):\n" + describe_methods()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="chainkv", description="chainkv: a sparse-first inference engine and agent sidecar"
    )
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser(
        "generate",
        help="generate text for one prompt",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=_methods_epilog(),
    )
    gen.add_argument("prompt", help="the prompt text ('-' reads standard input)")
    gen.add_argument(
        "--chat", action="store_true", help="apply the model's chat template to PROMPT as one user message"
    )
    gen.add_argument("--system", default=None, help="with --chat: a system message")
    gen.add_argument(
        "--json", action="store_true", help="print one JSON object (token_ids, text, finish_reason, usage)"
    )
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--presence-penalty", type=float, default=0.0, help="OpenAI's, in [-2, 2]")
    gen.add_argument("--frequency-penalty", type=float, default=0.0, help="OpenAI's, in [-2, 2]")
    gen.add_argument("--repetition-penalty", type=float, default=1.0, help="vLLM's, in [0.01, 100]; 1 is off")
    gen.add_argument("--stop", action="append", default=[], help="a stop string (repeatable)")
    gen.add_argument("--ignore-eos", action="store_true")
    add_engine_args(gen)

    srv = sub.add_parser(
        "serve",
        help="run the gRPC agent sidecar (chainkv.v1.Sidecar)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=_methods_epilog(),
    )
    add_flags(
        srv.add_argument_group("server (ServerOptions fields; env CHAINKV_<NAME>; YAML keys are the same names)"),
        ServerOptions,
    )
    add_engine_args(srv)

    cal = sub.add_parser(
        "calibrate", help="calibrate a method's head pattern (duo_attention) on generated passkey data"
    )
    cal.add_argument("calibrated_method", choices=["duo_attention"], help="the method to calibrate")
    cal.add_argument("--samples", type=int, default=8, help="passkey samples")
    cal.add_argument("--min-tokens", type=int, default=1024, help="shortest sample")
    cal.add_argument("--max-tokens", type=int, default=2048, help="longest sample")
    cal.add_argument("--n-sink", type=int, default=128, help="sink tokens of a streaming head")
    cal.add_argument("--n-recent", type=int, default=256, help="recent tokens of a streaming head")
    cal.add_argument("--calibration-seed", type=int, default=0, help="seed of the generated samples")
    cal.add_argument(
        "--out",
        default=None,
        metavar="FILE",
        help="where to write the pattern JSON (default: duo_pattern_<model>.json); use it with "
        "--method-arg pattern=FILE",
    )
    add_engine_args(cal)

    demo = sub.add_parser(
        "demo",
        help="run a multi-turn session with real tool round trips (forced tool choice) against a running sidecar",
    )
    demo.add_argument("--target", default="127.0.0.1:50051", help="the sidecar's address")
    demo.add_argument("--session", default=None, help="session id (default: a new random one)")
    demo.add_argument("--max-tokens", type=int, default=96)
    demo.add_argument("--token", default=None, help="bearer token, when the sidecar has auth on")
    demo.add_argument("--tls-ca", default=None, metavar="PEM", help="connect with TLS, trusting this CA")
    return parser
