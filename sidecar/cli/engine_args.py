"""EngineConfig <-> command-line flags: one flag per field, named after it (``page_size`` -> ``--page-size``).

``method_args`` is given as repeated ``--method-arg KEY=VALUE``; ``--config FILE.yaml`` loads
the same keys from YAML, and flags given on the command line override it.
"""

from __future__ import annotations

import argparse
import dataclasses
import typing

from engine.config import ConfigError, EngineConfig


def _flag_type(hint) -> type:
    """int, float and str flags as such; bools and lists are parsed by EngineConfig from text."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    base = args[0] if args else hint
    return base if base in (int, float, str) else str


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("engine (EngineConfig fields; YAML keys are the same names)")
    group.add_argument("--config", metavar="FILE.yaml", help="engine settings from a YAML file")
    hints = typing.get_type_hints(EngineConfig)
    docs = _field_docs()
    for f in dataclasses.fields(EngineConfig):
        if f.name == "method_args":
            group.add_argument(
                "--method-arg",
                dest="method_args",
                action="append",
                default=None,
                metavar="KEY=VALUE",
                help="a parameter of the method (repeatable); see the method list below",
            )
            continue
        flag = "--" + f.name.replace("_", "-")
        group.add_argument(
            flag,
            dest=f.name,
            type=_flag_type(hints[f.name]),
            default=None,
            help=f"{docs.get(f.name, '')} (default: {_default_text(f)})",
        )


def _default_text(f: dataclasses.Field) -> str:
    """A field's default as its flag would be written (a list: comma-separated, as the flag takes it)."""
    default = f.default_factory() if f.default is dataclasses.MISSING else f.default
    if isinstance(default, (list, tuple)):
        return ",".join(str(v) for v in default)
    return str(default).replace("%", "%%")


def engine_config_from_args(args: argparse.Namespace, yaml_values: dict | None = None) -> EngineConfig:
    """The flags over the ``--config`` YAML; ``yaml_values``: that YAML already read, less its server
    settings (``chainkv serve``, sidecar/cli/serve_config.py)."""
    values: dict = {}
    if yaml_values is not None:
        values.update(EngineConfig.from_dict(yaml_values).to_dict())
    elif getattr(args, "config", None):
        values.update(EngineConfig.from_yaml(args.config).to_dict())
    for f in dataclasses.fields(EngineConfig):
        v = getattr(args, f.name, None)
        if v is None:
            continue
        if f.name == "method_args":
            merged = dict(values.get("method_args") or {})
            for item in v:
                key, sep, value = item.partition("=")
                if not sep or not key:
                    raise ConfigError(f"--method-arg expects KEY=VALUE, got {item!r}")
                merged[key.strip()] = value.strip()
            v = merged
        values[f.name] = v
    return EngineConfig.from_dict(values)


def _field_docs() -> dict[str, str]:
    """The docstring under each EngineConfig field (its first paragraph, on one line), for --help."""
    import ast
    import inspect

    tree = ast.parse(inspect.getsource(EngineConfig))
    body = tree.body[0].body
    docs = {}
    for node, nxt in zip(body, body[1:]):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(nxt, ast.Expr)
            and isinstance(getattr(nxt, "value", None), ast.Constant)
        ):
            paragraph = str(nxt.value.value).strip().split("\n\n")[0]
            docs[node.target.id] = " ".join(paragraph.split()).replace("%", "%%")
    return docs
