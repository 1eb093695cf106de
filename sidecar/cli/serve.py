"""``chainkv serve``: the server's settings read and checked once, then the engine served until SIGTERM/SIGINT.

The settings (``EngineConfig`` and ``ServerOptions`` from flags, environment and YAML, the auth
tokens, the snapshot keys) are read and checked before the model is loaded: the TLS files parse,
every port (gRPC, ``--http-port``, ``--metrics-port``) can be bound, and the store answers (or,
with ``--allow-store-down``, the server starts with health NOT_SERVING until it does). Every port
is bound before "serving" is printed. Whatever fails gives one line on stderr and exit code 2.
With tensor parallelism, rank 0 of the launched engine (engine/tensor_parallel/launcher.py) is
given the ``ServeSetup`` read here and serves it (``serve_rank0``); it reads nothing again.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    from engine.config import EngineConfig
    from sidecar.grpc.options import ServerOptions
    from sidecar.store.base import SessionStore
    from sidecar.store.integrity import SnapshotKeys


@dataclass
class ServeSetup:
    """What ``chainkv serve`` read and checked. Plain values, so it crosses to tensor-parallel rank 0's
    process as it is (the store does not: each process opens its own client of it)."""

    config: EngineConfig
    options: ServerOptions
    hmac_keys: SnapshotKeys | None
    """The snapshot HMAC keys, read from ``options.snapshot_hmac_key_file``."""

    def open_store(self) -> SessionStore | None:
        from sidecar.store import open_store

        o = self.options
        return open_store(o.store, ttl_s=o.session_ttl_s, hmac_keys=self.hmac_keys)


def prepare_serve(args: argparse.Namespace) -> tuple[ServeSetup, SessionStore | None] | int:
    """The setup and the opened store of ``chainkv serve ARGS``, or an exit code after printing why not."""
    from sidecar.cli.serve_config import load_serve_settings
    from sidecar.grpc.endpoint import check_tls_files
    from sidecar.grpc.logs import setup_logging
    from sidecar.grpc.ports import check_free
    from sidecar.store.errors import StoreError
    from sidecar.store.integrity import load_keys

    try:
        config, options = load_serve_settings(args)
        setup_logging(options.log_level, options.log_format)
        check_tls_files(options)
        check_free(
            [
                ("--port", options.host, options.port),
                ("--http-port", options.http_host or options.host, options.http_port),
                ("--metrics-port", options.metrics_host, options.metrics_port),
            ]
        )
        setup = ServeSetup(config, options, load_keys(options.snapshot_hmac_key_file))
        store = setup.open_store()
        if store is not None and not options.allow_store_down:
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
    return setup, store


def one_line(e: BaseException) -> str:
    return " ".join(str(e).split())


def _startup_failed(e: BaseException) -> SystemExit:
    """A port, TLS file or store that failed after the setup's checks (taken meanwhile): one line, exit 2."""
    print(f"chainkv: {one_line(e)}", file=sys.stderr, flush=True)
    return SystemExit(2)


def cmd_serve(args: argparse.Namespace) -> int:
    prepared = prepare_serve(args)
    if isinstance(prepared, int):
        return prepared
    setup, store = prepared
    if setup.config.tensor_parallel_size > 1:
        # one process per rank; rank 0 serves, the others follow it (engine/tensor_parallel/launcher.py)
        from engine.tensor_parallel.launcher import launch

        if store is not None:
            store.close()  # rank 0 opens its own client
        return launch(setup.config, serve_rank0, setup)
    from engine.api import LLMEngine

    serve_engine(LLMEngine(setup.config), setup, store)
    return 0


def serve_rank0(engine, setup: ServeSetup) -> None:
    """Tensor-parallel rank 0, in its own process: the settings the parent read and checked, and this
    process's own client of the store the parent reached (a connection does not cross processes)."""
    from sidecar.grpc.logs import setup_logging

    setup_logging(setup.options.log_level, setup.options.log_format)
    serve_engine(engine, setup, setup.open_store())


def serve_engine(engine, setup: ServeSetup, store: SessionStore | None) -> None:
    """Serve ``engine`` (an LLMEngine, or rank 0's tensor-parallel front door) until SIGTERM/SIGINT."""
    import asyncio
    import signal

    from engine.config import ConfigError
    from sidecar.grpc.ports import PortUnavailable
    from sidecar.grpc.server import ServerHooks, SidecarServer
    from sidecar.store.errors import StoreError

    config, options = setup.config, setup.options
    hooks = ServerHooks()
    metrics_port = None
    if options.metrics_port is not None:
        from sidecar.grpc.metrics import MetricsHooks

        hooks = MetricsHooks(engine)
        try:
            metrics_port = hooks.serve(options.metrics_port, options.metrics_host)
        except OSError as e:
            raise _startup_failed(
                PortUnavailable(f"--metrics-port: cannot listen on {options.metrics_host}:{options.metrics_port}: {e}")
            ) from None

    async def main() -> None:
        server = SidecarServer(engine, options, store, hooks)
        http = None
        try:
            port = await server.start()
            if options.http_port is not None:
                from sidecar.http.app import HttpFront, HttpOptions

                http = HttpFront(
                    server,
                    HttpOptions(
                        host=options.http_host or options.host,
                        port=options.http_port,
                        served_model_name=options.served_model_name,
                    ),
                )
                http_port = await http.start()
        except (ConfigError, OSError, StoreError) as e:
            await server.stop(grace=0)
            raise _startup_failed(e) from None
        # every port is bound: announce them (metrics first, HTTP last: what scripts wait for)
        if metrics_port is not None:
            print(f"chainkv: metrics on http://{options.metrics_host}:{metrics_port}/metrics", flush=True)
        tp = f", tensor parallel {config.tensor_parallel_size}" if config.tensor_parallel_size > 1 else ""
        down = "" if server.serving else "; the store does not answer: health NOT_SERVING until it does"
        print(
            f"chainkv: serving chainkv.v1.Sidecar on {options.host}:{port} (model {engine.model_dir.name}, "
            f"method {config.method}, device {engine.device}{tp}, store {store.describe() if store else 'none'}, "
            f"auth {'on' if options.auth.enabled else 'off'}, snapshot hmac {'on' if store and store.hmac_keys else 'off'}{down})",
            flush=True,
        )
        if http is not None:
            print(
                f"chainkv: serving the OpenAI-compatible HTTP API on http://{options.http_host or options.host}:{http_port}/v1 "
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
        left = sum(s.snapshot_pending for s in server.sessions.all()) if server.sessions.has_store else 0
        print(
            f"chainkv: drained {turns - server.sessions.active_turns} turn(s); wrote {written} snapshot(s)"
            + (f"; {left} snapshot(s) NOT written" if left else ""),
            flush=True,
        )

    asyncio.run(main())
    print("chainkv: stopped", flush=True)
