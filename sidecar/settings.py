"""Settings declared once, on dataclass fields: a field is one flag, one environment variable and one YAML key.

A field made with :func:`setting` is a setting named after the field: ``session_ttl_s`` is the flag
``--session-ttl-s``, the environment variable ``CHAINKV_SESSION_TTL_S`` and the YAML key
``session_ttl_s``. Its default is the field's default; its help text is declared beside it. A field
made with :func:`setting_group` holds a dataclass whose own fields are settings too, under their own
names (``ServerOptions.limits.default_max_tokens`` is ``--default-max-tokens``); ``build`` turns that
dataclass into the field's value (the auth settings into an ``Authenticator``).

A value's kind comes from the field's type: ``bool`` (``--x`` / ``--no-x``; true/false, yes/no,
on/off, 1/0 as text), ``int``, ``float``, ``str`` (``X | None``: unset is None) and repeatable ones,
``list[str]`` or a setting with ``parse`` (the flag given several times, comma-separated in the
environment, a YAML list or comma-separated string; ``parse`` turns the items into the field's value).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import types
import typing
from dataclasses import dataclass
from typing import Any, Callable, Mapping

ENV_PREFIX = "CHAINKV_"
_SETTING = "chainkv.setting"
_GROUP = "chainkv.setting_group"
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


class SettingError(ValueError):
    """A setting's value cannot be read (not a number, not one of its choices, ...)."""


@dataclass(frozen=True)
class Setting:
    help: str
    metavar: str | None = None
    choices: tuple[str, ...] | None = None
    aliases: tuple[str, ...] = ()
    """Other flags for the same setting (older spellings: ``--store-ttl``)."""
    name: str | None = None
    """The setting's name when it is not the field's (``TenantLimits.overrides`` is ``tenant_limit``)."""
    parse: Callable[[list[str]], Any] | None = None
    """A repeatable setting's items -> the field's value."""


@dataclass(frozen=True)
class SettingGroup:
    settings: type
    """The dataclass whose fields are the settings."""
    build: Callable[[Any], Any] | None = None
    """An instance of ``settings`` -> the field's value; None: the instance is the value."""


def setting(default: Any, help: str, **kw: Any) -> Any:
    """A dataclass field that is a setting (``kw``: the other fields of :class:`Setting`)."""
    meta = {_SETTING: Setting(help, **kw)}
    if isinstance(default, (list, dict)):
        return dataclasses.field(default_factory=lambda: copy.deepcopy(default), metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def setting_group(settings: type, build: Callable[[Any], Any] | None = None) -> Any:
    """A dataclass field whose value is made from the settings of the dataclass ``settings``."""
    group = SettingGroup(settings, build)
    return dataclasses.field(default_factory=lambda: _made(group, settings()), metadata={_GROUP: group})


def _made(group: SettingGroup, values: Any) -> Any:
    return group.build(values) if group.build is not None else values


@dataclass(frozen=True)
class SettingSpec:
    """One setting as the command line, the environment and the YAML file spell it."""

    name: str
    """The YAML key (and the flag's dest)."""
    owner: type
    field: str
    kind: type
    """bool, int, float, str or list (repeatable)."""
    default: Any
    declared: Setting

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.name.upper()

    def read(self, value: Any, source: str) -> Any:
        """A value from the environment (text) or the YAML file, as the flag would have parsed it."""
        if self.kind is bool:
            if isinstance(value, bool):
                return value
            text = str(value).strip().lower()
            if text in _TRUE or text in _FALSE:
                return text in _TRUE
            raise SettingError(f"{source}: expected true or false, not {value!r}")
        if self.kind is list:
            items = value if isinstance(value, list) else [v for v in str(value).split(",") if v.strip()]
            return [str(v).strip() for v in items]
        if value is None:
            return None
        try:
            value = self.kind(value)
        except (TypeError, ValueError):
            raise SettingError(f"{source}: {value!r} is not a valid {self.name}") from None
        if self.declared.choices is not None and value not in self.declared.choices:
            raise SettingError(f"{source}: {value!r} is not one of {', '.join(self.declared.choices)}")
        return value

    def add_flag(self, parser: Any) -> None:
        """The setting's flag on ``parser`` (an ArgumentParser or one of its argument groups); it is set
        on the namespace only when given (the default is the field's)."""
        kw: dict[str, Any] = dict(dest=self.name, default=argparse.SUPPRESS, help=self._help())
        if self.kind is bool:
            kw["action"] = argparse.BooleanOptionalAction
        elif self.kind is list:
            kw["action"] = "append"
        else:
            kw["type"] = self.kind
        if self.declared.metavar is not None:
            kw["metavar"] = self.declared.metavar
        if self.declared.choices is not None:
            kw["choices"] = list(self.declared.choices)
        parser.add_argument(self.flag, *self.declared.aliases, **kw)

    def _help(self) -> str:
        text = self.declared.help
        if self.default is not None and self.default != [] and self.default != {}:
            text += f" (default: {self.default})"
        return text.replace("%", "%%")


def _kind(hint: Any, declared: Setting) -> type:
    if declared.parse is not None:
        return list
    optional = typing.get_origin(hint) in (typing.Union, types.UnionType)
    base = next(a for a in typing.get_args(hint) if a is not type(None)) if optional else hint
    if typing.get_origin(base) is list:
        return list
    if base in (bool, int, float, str):
        return base
    raise TypeError(f"a setting's type must be bool, int, float, str, a list or optional, not {hint!r}")


def settings_of(cls: type) -> list[SettingSpec]:
    """Every setting ``cls`` declares, its groups' included; a field that is neither is an error."""
    hints = typing.get_type_hints(cls)
    out: list[SettingSpec] = []
    for f in dataclasses.fields(cls):
        if _GROUP in f.metadata:
            out += settings_of(f.metadata[_GROUP].settings)
            continue
        declared = f.metadata.get(_SETTING)
        if declared is None:
            raise TypeError(f"{cls.__name__}.{f.name} is not declared as a setting")
        default = f.default_factory() if f.default is dataclasses.MISSING else f.default
        kind = _kind(hints[f.name], declared)
        shown = [] if declared.parse is not None else default  # a parsed setting's items: none by default
        out.append(SettingSpec(declared.name or f.name, cls, f.name, kind, shown, declared))
    return out


def add_flags(parser: Any, cls: type) -> None:
    """A flag for every setting of ``cls`` on ``parser`` (an ArgumentParser or one of its argument groups)."""
    for spec in settings_of(cls):
        spec.add_flag(parser)


def build(cls: type, values: Mapping[str, Any]) -> Any:
    """An instance of ``cls`` with the settings in ``values`` (by setting name), the rest at their defaults."""
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        group = f.metadata.get(_GROUP)
        if group is not None:
            kwargs[f.name] = _made(group, build(group.settings, values))
            continue
        declared: Setting = f.metadata[_SETTING]
        name = declared.name or f.name
        if name in values:
            value = values[name]
            kwargs[f.name] = declared.parse(value) if declared.parse is not None else value
    return cls(**kwargs)
