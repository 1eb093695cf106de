"""``chainkv serve``: the server's settings from the command line, then the engine served until SIGTERM/SIGINT.

The settings (engine config, ``ServerOptions``, session store, authenticator) are checked before
the model is loaded: the TLS files parse, every port (gRPC, ``--http-port``, ``--metrics-port``)
can be bound, and the store answers (or, with ``--allow-store-down``, the server starts with health
NOT_SERVING until it does). Every port is bound before "serving" is printed. Whatever fails gives
one line on stderr and exit code 2. With tensor parallelism, rank 0 of the launched engine runs
``serve_engine`` (engine/distributed/launcher.py).
"""

from __future__ import annotations

import argparse
import sys

from sidecar.cli_args import build_parser
from sidecar.engine_args import engine_config_from_args


def _serve_setup(args: argparse.Namespace):
    """(config, options, store, auth) from the command line, or an exit code after printing why not."""
    from sidecar.auth import Authenticator
    from sidecar.integrity import load_keys
    from sidecar.limits import TenantLimits
    from sidecar.logs import setup_logging
    from sidecar.protocol import Limits
    from sidecar.serve_config import apply_settings
    from sidecar.endpoint import check_tls_files
    from sidecar.ports import check_free
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
            allow_store_down=args.allow_store_down,
            tenant_limits=TenantLimits(
                args.max_sessions_per_tenant,
                args.max_tokens_per_turn,
                max_pinned_sessions_per_tenant=args.max_pinned_sessions_per_tenant,
                overrides=TenantLimits.parse_overrides(args.tenant_limit),
            ),
        )
        check_tls_files(options)
        check_free(
            [
                ("--port", args.host, args.port),
                ("--http-port", args.http_host or args.host, args.http_port),
                ("--metrics-port", args.metrics_host, args.metrics_port),
            ]
        )
        store = open_store(args.store, ttl_s=args.session_ttl_s, hmac_keys=load_keys(args.snapshot_hmac_key_file))
        if store is not None and not args.allow_store_down:
            try:
                store.ping()
            except StoreError as e:
                raise StoreError(
                    f"the session store {store.describe()} cannot be reached ({e}); start it, or pass "
                    f"--allow-store-down to serve with health NOT_SERVING until it answers"
                ) from None
    except (ValueError, OSError, StoreError) as e:
        print(f"chainkv: {one_line(e)}", file=sys.stderr)
        return 2
    return config, options, store, auth


def one_line(e: BaseException) -> str:
    return " ".join(str(e).split())


def _startup_failed(e: BaseException) -> SystemExit:
    """A port, TLS file or store that failed after the setup's checks (taken meanwhile): one line, exit 2."""
    print(f"chainkv: {one_line(e)}", file=sys.stderr, flush=True)
    return SystemExit(2)


def cmd_serve(args: argparse.Namespace) -> int:
    setup = _serve_setup(args)
    if isinstance(setup, int):
        return setup
    config = setup[0]
    if config.tensor_parallel_size > 1:
        # one process per rank; rank 0 serves, the others follow it (engine/distributed/launcher.py)
        from engine.distributed.launcher import launch

        return launch(config, serve_engine, args)
    from engine.api import LLMEngine

    serve_engine(LLMEngine(config), args, setup)
    return 0


def serve_engine(engine, args: argparse.Namespace, setup=None) -> None:
    """Serve ``engine`` (an LLMEngine, or rank 0's tensor-parallel front door) until SIGTERM/SIGINT."""
    import asyncio
    import signal

    from engine.config import ConfigError
    from sidecar.ports import PortUnavailable
    from sidecar.server import ServerHooks, SidecarServer
    from sidecar.store import StoreError

    if setup is None:
        setup = _serve_setup(args)
        if isinstance(setup, int):
            raise SystemExit(setup)
    config, options, store, auth = setup
    hooks = ServerHooks()
    metrics_port = None
    if args.metrics_port is not None:
        from sidecar.metrics import MetricsHooks

        hooks = MetricsHooks(engine)
        try:
            metrics_port = hooks.serve(args.metrics_port, args.metrics_host)
        except OSError as e:
            raise _startup_failed(
                PortUnavailable(f"--metrics-port: cannot listen on {args.metrics_host}:{args.metrics_port}: {e}")
            ) from None

    async def main() -> None:
        server = SidecarServer(engine, options, store, hooks)
        http = None
        try:
            port = await server.start()
            if args.http_port is not None:
                from sidecar.http.app import HttpFront, HttpOptions

                http = HttpFront(
                    server,
                    HttpOptions(
                        host=args.http_host or args.host, port=args.http_port, served_model_name=args.served_model_name
                    ),
                )
                http_port = await http.start()
        except (ConfigError, OSError, StoreError) as e:
            await server.stop(grace=0)
            raise _startup_failed(e) from None
        # every port is bound: announce them (metrics first, HTTP last: what scripts wait for)
        if metrics_port is not None:
            print(f"chainkv: metrics on http://{args.metrics_host}:{metrics_port}/metrics", flush=True)
        tp = f", tensor parallel {config.tensor_parallel_size}" if config.tensor_parallel_size > 1 else ""
        down = "" if server.serving else "; the store does not answer: health NOT_SERVING until it does"
        print(
            f"chainkv: serving chainkv.v1.Sidecar on {args.host}:{port} (model {engine.model_dir.name}, "
            f"method {config.method}, device {engine.device}{tp}, store {store.describe() if store else 'none'}, "
            f"auth {'on' if auth.enabled else 'off'}, snapshot hmac {'on' if store and store.hmac_keys else 'off'}{down})",
            flush=True,
        )
        if http is not None:
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
