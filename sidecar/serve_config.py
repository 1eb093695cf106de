"""``chainkv serve`` settings from three places, under one name each.

A serve flag ``--snapshot-hmac-key-file`` is also the YAML key ``snapshot_hmac_key_file`` (in the
``--config`` file, beside the EngineConfig fields) and the environment variable
``CHAINKV_SNAPSHOT_HMAC_KEY_FILE``. Precedence: the command line, then the environment, then the
YAML file, then the flag's default. Engine fields keep their own rule (YAML, overridden by
flags). Kubernetes mounts the YAML from a ConfigMap and sets secrets' paths through env (with
``enableServiceLinks: false``: a Service named ``chainkv`` would otherwise inject
``CHAINKV_PORT=tcp://...``).
"""

from __future__ import annotations

import argparse
import dataclasses
import os

from engine.config import ConfigError, EngineConfig, load_yaml

ENV_PREFIX = "CHAINKV_"
# serve flags that are not server settings
_NOT_SETTINGS = {"command", "config", "help"}


def _serve_actions(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    serve = sub.choices["serve"]
    engine_fields = {f.name for f in dataclasses.fields(EngineConfig)}
    return {
        a.dest: a
        for a in serve._actions
        if a.dest not in engine_fields and a.dest not in _NOT_SETTINGS and a.option_strings
    }


def _convert(action: argparse.Action, value, source: str):
    """A YAML or env value as the flag would have parsed it."""
    if isinstance(action, argparse.BooleanOptionalAction):
        if isinstance(value, bool):
            return value
        text = str(value).strip().lower()
        if text in ("1", "true", "yes", "on"):
            return True
        if text in ("0", "false", "no", "off"):
            return False
        raise ConfigError(f"{source}: expected true or false, not {value!r}")
    if isinstance(action, argparse._AppendAction):
        items = value if isinstance(value, list) else [v for v in str(value).split(",") if v.strip()]
        return [str(v).strip() for v in items]
    if value is None:
        return None
    try:
        return action.type(value) if action.type is not None else str(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{source}: {value!r} is not a valid {action.dest}") from None


def apply_settings(args: argparse.Namespace, parser: argparse.ArgumentParser, environ=None) -> None:
    """Fill serve settings left at their defaults from the environment, then from the YAML file;
    the YAML's engine fields are left for ``engine_config_from_args``."""
    environ = os.environ if environ is None else environ
    actions = _serve_actions(parser)
    yaml_values: dict = {}
    if getattr(args, "config", None):
        loaded = load_yaml(args.config)
        if not isinstance(loaded, dict):
            raise ConfigError(f"{args.config}: expected a mapping at the top level")
        yaml_values = {k: loaded.pop(k) for k in list(loaded) if k in actions}
        if yaml_values:  # the engine part only, for EngineConfig.from_yaml's strict key check
            args.config_values = loaded
    for dest, action in actions.items():
        if getattr(args, dest) != action.default:
            continue  # given on the command line
        env = environ.get(ENV_PREFIX + dest.upper())
        if env is not None and env != "":
            setattr(args, dest, _convert(action, env, ENV_PREFIX + dest.upper()))
        elif dest in yaml_values:
            setattr(args, dest, _convert(action, yaml_values[dest], f"{args.config}: {dest}"))
