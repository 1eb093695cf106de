"""``chainkv serve`` settings from three places, under one name each.

Every ``ServerOptions`` setting (sidecar/grpc/options.py) has one name: ``snapshot_hmac_key_file`` is the
flag ``--snapshot-hmac-key-file``, the YAML key ``snapshot_hmac_key_file`` (in the ``--config`` file,
beside the EngineConfig fields) and the environment variable ``CHAINKV_SNAPSHOT_HMAC_KEY_FILE``.
Precedence: the command line, then the environment, then the YAML file, then the field's default.
Engine fields keep their own rule (YAML, overridden by flags). Kubernetes mounts the YAML from a
ConfigMap and sets secrets' paths through env (with ``enableServiceLinks: false``: a Service named
``chainkv`` would otherwise inject ``CHAINKV_PORT=tcp://...``).
"""

from __future__ import annotations

import argparse
import os
from typing import Any, Mapping

from engine.config import ConfigError, EngineConfig, load_yaml
from sidecar.cli.engine_args import engine_config_from_args
from sidecar.grpc.options import ServerOptions
from sidecar.settings import build, settings_of


def load_serve_settings(
    args: argparse.Namespace, environ: Mapping[str, str] | None = None
) -> tuple[EngineConfig, ServerOptions]:
    """The engine config and the server options of ``chainkv serve ARGS`` (``environ``: os.environ)."""
    environ = os.environ if environ is None else environ
    specs = settings_of(ServerOptions)
    yaml_values: dict[str, Any] = {}
    engine_values = None
    if getattr(args, "config", None):
        loaded = load_yaml(args.config)
        if not isinstance(loaded, dict):
            raise ConfigError(f"{args.config}: expected a mapping at the top level")
        server_names = {s.name for s in specs}
        yaml_values = {k: v for k, v in loaded.items() if k in server_names}
        engine_values = {k: v for k, v in loaded.items() if k not in server_names}
    values: dict[str, Any] = {}
    for spec in specs:
        env = environ.get(spec.env)
        if hasattr(args, spec.name):  # given on the command line (flags are set only when given)
            values[spec.name] = getattr(args, spec.name)
        elif env is not None and env != "":
            values[spec.name] = spec.read(env, spec.env)
        elif spec.name in yaml_values:
            values[spec.name] = spec.read(yaml_values[spec.name], f"{args.config}: {spec.name}")
    return engine_config_from_args(args, engine_values), build(ServerOptions, values)
