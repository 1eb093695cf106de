"""The ``chainkv`` command line: its parser, every subcommand's flags (generate, serve, calibrate, demo).

The engine flags every model-loading command shares come from ``sidecar.engine_args``; ``chainkv
serve``'s server flags are also read from the environment and the YAML file (``sidecar.serve_config``,
which finds them in this parser's ``serve`` subcommand).
"""

from __future__ import annotations

import argparse

from sidecar.engine_args import add_engine_args


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
    g = srv.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0 for every interface)")
    g.add_argument("--port", type=int, default=50051, help="0 picks a free port (printed at start)")
    g.add_argument(
        "--store",
        default=None,
        metavar="URL",
        help="session store: redis://host:port/db, rediss://..., file:///path (or a folder), or none "
        "(default: the folder sessions/ under $CHAINKV_CACHE or ~/.cache/chainkv)",
    )
    g.add_argument(
        "--allow-store-down",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="start even when the store does not answer: gRPC health NOT_SERVING (HTTP /health 503) "
        "until it does; without it, an unreachable store stops the start (exit code 2)",
    )
    g.add_argument(
        "--session-ttl-s",
        "--store-ttl",
        dest="session_ttl_s",
        type=float,
        default=7 * 24 * 3600.0,
        metavar="SECONDS",
        help="sessions unused this long expire: ended on the replica, and their stored "
        "snapshots expire this long after their last write",
    )
    g.add_argument(
        "--snapshot-kv",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="snapshots carry the KV (resume without recompute); --no-snapshot-kv keeps only the history",
    )
    g.add_argument("--default-max-tokens", type=int, default=256, help="max_tokens of a Turn that does not set it")
    g.add_argument("--max-message-bytes", type=int, default=4 * 2**20, help="largest gRPC message accepted or sent")
    g.add_argument(
        "--session-idle-s",
        type=float,
        default=3600.0,
        help="free sessions idle this long whose snapshot is committed (they resume from the store)",
    )
    g.add_argument("--grace-s", type=float, default=30.0, help="shutdown: time for running turns to finish")
    g.add_argument(
        "--auth-token",
        action="append",
        default=[],
        metavar="TOKEN=TENANT",
        help="accept 'authorization: Bearer TOKEN' as TENANT (repeatable); with none, auth is off",
    )
    g.add_argument("--auth-file", action="append", default=[], metavar="FILE", help="a file of 'TOKEN TENANT' lines")
    g.add_argument("--tls-cert", default=None, metavar="PEM", help="serve TLS with this certificate chain")
    g.add_argument("--tls-key", default=None, metavar="PEM", help="the certificate's private key")
    g.add_argument("--tls-client-ca", default=None, metavar="PEM", help="require client certificates signed by this CA")
    g.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING, ...")
    g.add_argument("--log-format", default="text", choices=["text", "json"], help="json: one object per line")
    g.add_argument(
        "--http-port",
        type=int,
        default=None,
        metavar="PORT",
        help="also serve the OpenAI-compatible HTTP API on this port (0 picks one); unset: no HTTP",
    )
    g.add_argument("--http-host", default=None, help="address of the HTTP port (default: --host)")
    g.add_argument(
        "--served-model-name", default=None, help="the model name HTTP clients send (default: the model folder's name)"
    )
    g.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        metavar="PORT",
        help="serve Prometheus metrics on this port (0 picks one); unset: no metrics",
    )
    g.add_argument(
        "--metrics-host",
        default="127.0.0.1",
        help="address of the metrics port (like --host: 0.0.0.0 for every interface)",
    )
    g.add_argument(
        "--durability",
        default="async",
        choices=["async", "sync"],
        help="async: a turn's completion is sent at once and its snapshot written behind it; sync: "
        "only after its snapshot commits (no acknowledged turn is lost if this replica dies)",
    )
    g.add_argument(
        "--snapshot-hmac-key-file",
        default=None,
        metavar="FILE",
        help="sign stored sessions with HMAC-SHA256 and refuse any that fail it (one key per line; "
        "the first signs, all verify)",
    )
    g.add_argument(
        "--max-sessions-per-tenant",
        type=int,
        default=None,
        metavar="N",
        help="live sessions one tenant may hold here (more: RESOURCE_EXHAUSTED)",
    )
    g.add_argument(
        "--max-tokens-per-turn",
        type=int,
        default=None,
        metavar="N",
        help="max_tokens and new prompt tokens one turn may take (more: INVALID_ARGUMENT)",
    )
    g.add_argument(
        "--max-pinned-sessions-per-tenant",
        type=int,
        default=None,
        metavar="N",
        help="sessions one tenant may pin on the accelerator at once with agent hints (more: RESOURCE_EXHAUSTED)",
    )
    g.add_argument(
        "--tenant-limit",
        action="append",
        default=[],
        metavar="TENANT:KEY=N[,KEY=N]",
        help="one tenant's own max_sessions_per_tenant / max_tokens_per_turn / max_pinned_sessions_per_tenant (repeatable)",
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
