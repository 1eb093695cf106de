"""Which sparse method a sequence uses: :class:`MethodSpec` (its name, budget and parameters, the one
spelling of the method settings every layer reads), the parsing of its ``method_args`` into a
method's ``Params`` dataclass, and :class:`MethodError` for any of them that is invalid.

This is the declaration side of a method, apart from the hooks it implements (engine/lifecycle.py):
requests, sessions, snapshots and the front door carry a MethodSpec without needing the Lifecycle
Contract, and a method's constructor checks its spec through ``build_params``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Mapping


class MethodError(ValueError):
    """A method name, budget or parameter is invalid."""


@dataclass
class MethodSpec:
    """Which method a sequence uses, with its budget and parameters (same names as EngineConfig)."""

    method: str = "dense"
    budget: int | None = None
    budget_ratio: float | None = None
    method_args: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.budget is not None and self.budget_ratio is not None:
            raise MethodError("give budget (tokens per head) or budget_ratio (fraction kept), not both")
        if self.budget is not None and (not isinstance(self.budget, int) or self.budget < 1):
            raise MethodError(f"budget must be a positive number of tokens, not {self.budget!r}")
        if self.budget_ratio is not None and not (0 < self.budget_ratio <= 1):
            raise MethodError(f"budget_ratio must be in (0, 1], not {self.budget_ratio!r}")

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        """The method settings, as every layer spells them: EngineConfig's fields, a snapshot's
        method record, the gRPC Turn's and Session's fields and the HTTP ``chainkv`` extension."""
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def from_record(cls, record: Mapping[str, Any]) -> "MethodSpec":
        """The spec a mapping of its field names holds (a snapshot's method record); keys that are
        not method settings are ignored, a missing one is a KeyError."""
        values = {name: record[name] for name in cls.field_names()}
        return cls(**{**values, "method_args": dict(values["method_args"] or {})})

    @classmethod
    def from_config(cls, config: Any) -> "MethodSpec":
        """The default spec an EngineConfig names (its fields of the same names)."""
        return cls.from_record({name: getattr(config, name) for name in cls.field_names()})

    def to_record(self) -> dict[str, Any]:
        """The spec as a plain mapping of its field names (a snapshot's method record)."""
        return {name: getattr(self, name) for name in self.field_names()}

    def copy(self) -> "MethodSpec":
        """A copy that shares nothing mutable with this spec."""
        return MethodSpec.from_record(self.to_record())

    def key(self) -> tuple:
        return (
            self.method,
            self.budget,
            self.budget_ratio,
            tuple(sorted((k, repr(v)) for k, v in self.method_args.items())),
        )


def build_params(cls: type, args: Mapping[str, Any]) -> Any:
    """The method's Params dataclass from ``method_args``, with a clear error for unknown keys."""
    if cls.Params is None:
        if args:
            raise MethodError(f"method {cls.name!r} takes no parameters, got {', '.join(sorted(args))}")
        return None
    names = {f.name: f for f in dataclasses.fields(cls.Params)}
    unknown = sorted(set(args) - set(names))
    if unknown:
        raise MethodError(
            f"method {cls.name!r} has no parameter(s) {', '.join(unknown)}; it takes {', '.join(names) or 'none'}"
        )
    values = {}
    for key, value in args.items():
        default = names[key].default
        if isinstance(value, str) and not isinstance(default, str) and default is not dataclasses.MISSING:
            value = _parse_value(cls.name, key, value, int if default is None else type(default))
        values[key] = value
    return cls.Params(**values)


def _parse_value(method: str, key: str, text: str, kind: type) -> Any:
    try:
        if kind is bool:
            if text.lower() in ("1", "true", "yes", "on"):
                return True
            if text.lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError(text)
        if kind in (list, tuple):
            return kind(int(x) for x in text.split(",") if x.strip())
        return kind(text)
    except ValueError:
        raise MethodError(f"{method}.{key} expects {kind.__name__}, got {text!r}") from None
