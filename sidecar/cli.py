"""The ``chainkv`` command.

chainkv serve [ENGINE FLAGS] [--port 50051] [--store redis://...|file://...|none] [--auth-token T=TENANT]
chainkv demo [--target 127.0.0.1:50051]
chainkv generate [--model M] [--method NAME] [--budget N] [--max-tokens N] [--chat] [--json] PROMPT
chainkv calibrate duo_attention [--model M] [--samples N] [--out FILE]
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
        "--tenant-limit",
        action="append",
        default=[],
        metavar="TENANT:KEY=N[,KEY=N]",
        help="one tenant's own max_sessions_per_tenant / max_tokens_per_turn (repeatable)",
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


def _serve_setup(args: argparse.Namespace):
    """(config, options, store, auth) from the command line, or an exit code after printing why not."""
    from sidecar.auth import Authenticator
    from sidecar.integrity import load_keys
    from sidecar.limits import TenantLimits
    from sidecar.logs import setup_logging
    from sidecar.protocol import Limits
    from sidecar.serve_config import apply_settings
    from sidecar.server import ServerOptions
    from sidecar.store import StoreError, open_store

    try:
        apply_settings(args, build_parser())
        setup_logging(args.log_level, args.log_format)
        config = engine_config_from_args(args)
        auth = Authenticator.from_args(args.auth_token, args.auth_file)
        options = ServerOptions(
            host=args.host,
            port=args.port,
            max_message_bytes=args.max_message_bytes,
            limits=Limits(default_max_tokens=args.default_max_tokens),
            snapshot_kv=args.snapshot_kv,
            session_idle_s=args.session_idle_s,
            session_ttl_s=args.session_ttl_s,
            grace_s=args.grace_s,
            auth=auth,
            durability=args.durability,
            tls_cert=args.tls_cert,
            tls_key=args.tls_key,
            tls_client_ca=args.tls_client_ca,
            tenant_limits=TenantLimits(
                args.max_sessions_per_tenant, args.max_tokens_per_turn, TenantLimits.parse_overrides(args.tenant_limit)
            ),
        )
        store = open_store(args.store, ttl_s=args.session_ttl_s, hmac_keys=load_keys(args.snapshot_hmac_key_file))
        check_port_free(args.host, args.port)
    except (ValueError, OSError, StoreError) as e:
        print(f"chainkv: {e}", file=sys.stderr)
        return 2
    return config, options, store, auth


def cmd_serve(args: argparse.Namespace) -> int:
    setup = _serve_setup(args)
    if isinstance(setup, int):
        return setup
    config = setup[0]
    if config.tensor_parallel_size > 1:
        # one process per rank; rank 0 serves, the others follow it (engine/distributed/launcher.py)
        from engine.distributed.launcher import launch

        return launch(config, serve_engine, args)
    from engine.llm import LLMEngine

    serve_engine(LLMEngine(config), args, setup)
    return 0


def serve_engine(engine, args: argparse.Namespace, setup=None) -> None:
    """Serve ``engine`` (an LLMEngine, or rank 0's tensor-parallel front door) until SIGTERM/SIGINT."""
    import asyncio
    import signal

    from sidecar.server import ServerHooks, SidecarServer

    if setup is None:
        setup = _serve_setup(args)
        if isinstance(setup, int):
            raise SystemExit(setup)
    config, options, store, auth = setup
    hooks = ServerHooks()
    if args.metrics_port is not None:
        from sidecar.metrics import MetricsHooks

        hooks = MetricsHooks(engine)
        metrics_port = hooks.serve(args.metrics_port, args.metrics_host)
        print(f"chainkv: metrics on http://{args.metrics_host}:{metrics_port}/metrics", flush=True)

    async def main() -> None:
        server = SidecarServer(engine, options, store, hooks)
        port = await server.start()
        tp = f", tensor parallel {config.tensor_parallel_size}" if config.tensor_parallel_size > 1 else ""
        print(
            f"chainkv: serving chainkv.v1.Sidecar on {args.host}:{port} (model {engine.model_dir.name}, "
            f"method {config.method}, device {engine.device}{tp}, store {store.describe() if store else 'none'}, "
            f"auth {'on' if auth.enabled else 'off'}, snapshot hmac {'on' if store and store.hmac_keys else 'off'})",
            flush=True,
        )
        http = None
        if args.http_port is not None:
            from sidecar.http.app import HttpFront, HttpOptions

            http = HttpFront(
                server,
                HttpOptions(
                    host=args.http_host or args.host, port=args.http_port, served_model_name=args.served_model_name
                ),
            )
            http_port = await http.start()
            print(
                f"chainkv: serving the OpenAI-compatible HTTP API on http://{args.http_host or args.host}:{http_port}/v1 "
                f"(model {http.app.state.backend.model_name})",
                flush=True,
            )
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        turns = server.sessions.active_turns
        pending = server.writer.pending if server.writer is not None else 0
        writes = server.writer.writes if server.writer is not None else 0
        print(
            f"chainkv: shutting down: draining {turns} running turn(s), writing {pending} pending snapshot(s)",
            flush=True,
        )
        if http is not None:
            server.draining = True  # new HTTP requests get 503 while running turns finish
        await server.stop()
        if http is not None:
            await http.stop()
        written = (server.writer.writes - writes) if server.writer is not None else 0
        left = sum(s.snapshot_pending for s in server.sessions.all()) if server.store is not None else 0
        print(
            f"chainkv: drained {turns - server.sessions.active_turns} turn(s); wrote {written} snapshot(s)"
            + (f"; {left} snapshot(s) NOT written" if left else ""),
            flush=True,
        )

    asyncio.run(main())
    print("chainkv: stopped", flush=True)


def check_port_free(host: str, port: int) -> None:
    """Raise OSError when ``host:port`` cannot be bound (checked before the model is loaded)."""
    import socket

    if port == 0:
        return
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError as e:
            raise OSError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None


def cmd_demo(args: argparse.Namespace) -> int:
    from sidecar.demo import run_demo

    return run_demo(args.target, args.session, args.max_tokens, args.token, args.tls_ca)


def cmd_generate(args: argparse.Namespace) -> int:
    from engine.llm import LLMEngine, RequestError
    from engine.sampling import SamplingError, SamplingParams

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
                        "evicted_tokens": engine.stats()["evicted_tokens"],
                    },
                    "method": config.method,
                }
            )
        )
    else:
        print()
    return 0


def cmd_calibrate(args: argparse.Namespace) -> int:
    from engine.methods.duo_calibration import calibrate, write_pattern
    from engine.llm import LLMEngine

    if args.samples < 1 or not 0 < args.min_tokens <= args.max_tokens:
        print("chainkv: --samples must be >= 1 and 0 < --min-tokens <= --max-tokens", file=sys.stderr)
        return 2
    engine = LLMEngine(engine_config_from_args(args), num_pages=1)
    pattern = calibrate(
        engine,
        samples=args.samples,
        min_tokens=args.min_tokens,
        max_tokens=args.max_tokens,
        n_sink=args.n_sink,
        n_recent=args.n_recent,
        seed=args.calibration_seed,
    )
    path = write_pattern(pattern, args.out or f"duo_pattern_{pattern['model']}.json")
    cal = pattern["calibration"]
    print(
        f"wrote {path}: {pattern['num_layers']} layers x {pattern['num_kv_heads']} kv-heads, "
        f"{cal['answered']}/{cal['samples']} passkeys answered"
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    from engine.lifecycle import MethodError
    from engine.model.loader import ModelLoadError

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
