"""The Prefix-Cache Pruning rule, in one place: what a valid pruning is, and which spans are due.

Three callers share it: ``EngineConfig`` checks its ``prune_*`` settings with it, ``ChainCache``
checks every pruning and picks the spans its automatic rule prunes at a turn's end, and the
sidecar's PruneHistory checks a request with it before looking the session up, then asks the
engine to prune the spans it selects. Violations raise ``PruneRuleError`` (a ``ValueError``); the
config turns it into a ``ConfigError``, the sidecar into INVALID_ARGUMENT.

The rule: a span of the history written by one of ``prune_roles`` is due once it is ``prune_lag``
or more turns old, or, with ``prune_trigger_tokens``, as soon as it is longer than that. Pruning
keeps the history (the tokens) and shrinks the span's KV: ``drop`` removes all of it,
``keep_ratio`` keeps that fraction of its tokens, the ones recent queries attend most, ranked
per layer across kv-heads (``global``) or per kv-head (``per_head``).
"""

from __future__ import annotations

from typing import Iterable, Iterator, Protocol

POLICIES = ("drop", "keep_ratio")
SCOPES = ("global", "per_head")


class PruneRuleError(ValueError):
    """A pruning request or setting the rule does not allow."""


class PrunableSpan(Protocol):
    start: int
    end: int
    role: str
    turn: int
    pruned: bool


def check_policy(policy: str | None = None, keep_ratio: float | None = None, scope: str | None = None) -> None:
    """How to prune; None stands for the configured default and is not checked."""
    if policy is not None and policy not in POLICIES:
        raise PruneRuleError(f"prune_policy must be drop or keep_ratio, not {policy!r}")
    if keep_ratio is not None and not 0 <= keep_ratio <= 1:  # NaN fails too
        raise PruneRuleError(f"prune_keep_ratio must be in [0, 1], not {keep_ratio}")
    if scope is not None and scope not in SCOPES:
        raise PruneRuleError(f"prune_scope must be global or per_head, not {scope!r}")


def check_settings(lag: int | None, trigger_tokens: int | None, window: int) -> None:
    """When to prune automatically, and the query window ``keep_ratio`` scores with."""
    if lag is not None and lag < 0:
        raise PruneRuleError(f"prune_lag must be >= 0, not {lag}")
    if trigger_tokens is not None and trigger_tokens < 1:
        raise PruneRuleError("prune_trigger_tokens must be >= 1")
    if window < 1:
        raise PruneRuleError(f"prune_window must be >= 1, not {window}")


def check_span(start: int, end: int, history_len: int | None = None) -> None:
    """A span of history positions [start, end) to prune (inside a ``history_len``-token history)."""
    if not start < end:
        raise PruneRuleError("a span to prune needs start < end")
    if start < 0 or history_len is not None and end > history_len:
        raise PruneRuleError(f"span ({start}, {end}) lies outside the {history_len}-token history")


def due_spans(
    spans: Iterable[PrunableSpan],
    turn_index: int,
    roles: Iterable[str],
    *,
    lag: int | None = None,
    trigger_tokens: int | None = None,
) -> Iterator[tuple[int, int, str]]:
    """The spans the rule prunes now, as (start, end, reason); reason is ``lag`` or ``trigger``.
    Lazy: a span pruned while the caller iterates is seen as pruned."""
    roles = set(roles)
    for span in spans:
        if span.pruned or span.role not in roles:
            continue
        old = lag is not None and turn_index - span.turn >= lag
        big = trigger_tokens is not None and span.end - span.start > trigger_tokens
        if old or big:
            yield span.start, span.end, "lag" if old else "trigger"
