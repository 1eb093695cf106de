"""The Prefix-Cache Pruning rule (engine/prune_rule.py): its checks, the spans it selects, and the
config and chain that use it (fast tier: no model)."""

from __future__ import annotations

import math

import pytest

from engine.chain import TaggedSpan
from engine.config import ConfigError, EngineConfig
from engine.prune_rule import PruneRuleError, check_policy, check_settings, check_span, due_spans


@pytest.mark.parametrize(
    "policy, keep_ratio, scope",
    [
        ("zap", None, None),
        (None, -0.1, None),
        (None, 1.5, None),
        (None, math.nan, None),
        (None, None, "?"),
        ("keep_ratio", math.inf, "per_head"),
    ],
)
def test_bad_policies_are_refused(policy, keep_ratio, scope):
    with pytest.raises(PruneRuleError):
        check_policy(policy, keep_ratio, scope)


def test_good_policies_and_defaults_pass():
    check_policy()  # None: the configured default
    check_policy("drop", 0.0, "global")
    check_policy("keep_ratio", 1.0, "per_head")


@pytest.mark.parametrize("start, end, n", [(5, 5, None), (6, 5, None), (-1, 3, None), (0, 11, 10)])
def test_bad_spans_are_refused(start, end, n):
    with pytest.raises(PruneRuleError):
        check_span(start, end, n)


def test_settings_are_checked_and_the_config_reports_them_as_config_errors():
    check_settings(None, None, 1)
    for bad in ((-1, None, 32), (None, 0, 32), (None, None, 0)):
        with pytest.raises(PruneRuleError):
            check_settings(*bad)
    for field, value in (
        ("prune_lag", -1),
        ("prune_policy", "zap"),
        ("prune_keep_ratio", 2.0),
        ("prune_scope", "x"),
        ("prune_trigger_tokens", 0),
        ("prune_window", 0),
    ):
        with pytest.raises(ConfigError, match=field):
            EngineConfig(**{field: value})


def test_due_spans_by_role_age_and_size_lazily():
    spans = [
        TaggedSpan(0, 10, "system", turn=0),
        TaggedSpan(10, 40, "tool", turn=0),
        TaggedSpan(40, 45, "tool", turn=2),
        TaggedSpan(45, 200, "tool", turn=3),
        TaggedSpan(200, 260, "tool", turn=1, pruned=True),
    ]
    assert list(due_spans(spans, 3, ["tool"], lag=2)) == [(10, 40, "lag")]
    assert list(due_spans(spans, 3, ["tool"], trigger_tokens=100)) == [(45, 200, "trigger")]
    assert list(due_spans(spans, 3, ["tool", "system"], lag=3)) == [(0, 10, "lag"), (10, 40, "lag")]
    assert list(due_spans(spans, 3, ["tool"])) == []  # neither age nor size given
    lazy = due_spans(spans, 3, ["tool"], lag=0)
    assert next(lazy) == (10, 40, "lag")
    spans[2].pruned = True  # pruned while the caller iterates: skipped
    assert list(lazy) == [(45, 200, "lag")]
