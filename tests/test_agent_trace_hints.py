"""benchmarks/agent_trace.py's ``+hints`` configurations send agent hints where an agent framework
would: a priority with every turn, a pin with every turn a tool result follows (TTL: the tool's run
time plus slack) and the tool's run time as its expected return, a release with the last turn,
before the session ends; a refused pin is dropped (the expected return kept) and the turn sent
again. The trace runs against a recording client that builds each TurnRequest with the real client
code and reads its hints back with the sidecar's own parser. No model: fast."""

from __future__ import annotations

import argparse
import asyncio

import grpc
import pytest

from agent_adapters.messages import TextDelta, TurnResult, Usage
from agent_adapters.retry import ChainKVError
from agent_adapters.turns import build_turn_request
from benchmarks.agent_hints import HintPolicy, TurnHints
from benchmarks.agent_trace_sessions import Config, config_names, run_config
from benchmarks.agent_trace_shape import TraceParams, make_trace
from engine.chain.hints import SessionHints
from sidecar.turns.protocol import session_hints
from sidecar.turns.request import from_proto


class RecordingClient:
    """Runs every turn at once and records, in order, ("turn", session, hints) and ("end", session);
    ``refuse_pins``: this many pinned turns are refused as the server refuses a pin past its share."""

    def __init__(self, refuse_pins: int = 0):
        self.calls: list[tuple] = []
        self.refuse_pins = refuse_pins

    async def stream_turn(self, session_id, messages, **options):
        req = build_turn_request(session_id, messages, **options)
        hints = session_hints(from_proto(req))
        if hints is not None and hints.pin_ttl_s is not None and self.refuse_pins:
            self.refuse_pins -= 1
            self.calls.append(("refused", session_id, hints))
            raise ChainKVError(grpc.StatusCode.RESOURCE_EXHAUSTED, "pinned sessions would pass their share")
        self.calls.append(("turn", session_id, hints))
        yield TextDelta("ok")
        yield TurnResult(session_id, req.request_id, 0, 0, "length", "ok", (), (), Usage(generated_tokens=2), False)

    async def end_session(self, session_id):
        self.calls.append(("end", session_id))


def args(**kw):
    base = dict(concurrency=2, output_tokens=2, method_budget=64, tool_prune_lag=1, hint_priority=3)
    return argparse.Namespace(**{**base, "pin_slack_s": 0.5, "max_pin_ttl_s": None, **kw})


def replay(cfg: str, client: RecordingClient, **kw):
    trace, thinks = make_trace(TraceParams(sessions=2, turns=4, think_s=0.0, tool_median=4, system_words=5))
    thinks = [[0.0, 0.002, 0.001, 0.003] for _ in thinks]  # known tool times (seconds)
    rows = asyncio.run(run_config(client, Config.parse(cfg), trace, thinks, args(**kw), "t"))
    return rows, thinks


def test_hinted_sessions_pin_while_each_tool_runs_and_release_at_the_end():
    client = RecordingClient()
    rows, thinks = replay("dense+hints", client)
    for s in range(2):
        sid = f"t-dense-hints-s{s}"
        mine = [c for c in client.calls if c[1] == sid]
        assert [c[0] for c in mine] == ["turn"] * 4 + ["end"]  # the release comes before the session ends
        for k, (_, _, hints) in enumerate(mine[:3]):
            tool_s = thinks[s][k + 1]
            assert hints == SessionHints(
                priority=3, pin_ttl_s=pytest.approx(tool_s + 0.5), expected_return_s=pytest.approx(tool_s)
            ), k
        assert mine[3][2] == SessionHints(priority=3, release=True)
    assert all(r["hints"]["pin_refused"] is False for r in rows)
    assert sorted((r["turn"], r["hints"]["release"]) for r in rows if r["hints"]["pin_ttl_s"] is None) == [
        (3, True),
        (3, True),
    ]


def test_configurations_without_hints_send_none():
    client = RecordingClient()
    rows, _ = replay("dense", client)
    assert [c[2] for c in client.calls if c[0] == "turn"] == [None] * 8
    assert all(r["hints"] is None for r in rows)


def test_a_refused_pin_is_dropped_and_the_turn_sent_again():
    client = RecordingClient(refuse_pins=1)
    rows, _ = replay("snapkv+hints", client)
    refused = [c for c in client.calls if c[0] == "refused"]
    assert len(refused) == 1
    sid = refused[0][1]
    again = client.calls[client.calls.index(refused[0]) + 1 :]
    sent = next(c for c in again if c[1] == sid)[2]  # the pin dropped, the expected return kept
    assert sent == SessionHints(priority=3, expected_return_s=refused[0][2].expected_return_s)
    assert sent.expected_return_s is not None
    assert sum(r["hints"]["pin_refused"] for r in rows) == 1 and len(rows) == 8


def test_pins_stay_within_the_servers_longest_and_are_off_when_it_allows_none():
    assert HintPolicy(1, 5.0, 2.0).for_turn(0, [0.0, 9.0, 0.0]) == TurnHints(
        priority=1, pin_ttl_s=2.0, expected_return_s=9.0
    )
    assert HintPolicy(1, 5.0, 0.0).for_turn(0, [0.0, 9.0, 0.0]) == TurnHints(priority=1, expected_return_s=9.0)
    assert HintPolicy(1, 5.0, 0.0).for_turn(0, [0.0, 0.0, 0.0]) == TurnHints(priority=1)  # no tool time to say
    assert HintPolicy(None, 5.0, 60.0).for_turn(2, [0.0, 9.0, 0.0]) == TurnHints(release=True)
    client = RecordingClient()
    replay("dense+hints", client, max_pin_ttl_s=0.5)
    assert {c[2].pin_ttl_s for c in client.calls if c[0] == "turn"} == {0.5, None}


def test_hints_flag_runs_each_chain_configuration_with_and_without_hints():
    assert config_names("nochain,dense,snapkv+prune", True) == [
        "nochain",
        "dense",
        "dense+hints",
        "snapkv+prune",
        "snapkv+prune+hints",
    ]
    assert config_names("dense,dense+hints", True) == ["dense", "dense+hints"]
    assert config_names("dense,snapkv", False) == ["dense", "snapkv"]
    with pytest.raises(SystemExit):
        Config.parse("nochain+hints")


def test_client_hint_options_reach_the_request_as_the_sidecar_reads_them():
    req = build_turn_request("s", [], priority=-4, pin_ttl_s=12.5)
    assert session_hints(from_proto(req)) == SessionHints(priority=-4, pin_ttl_s=12.5)
    assert session_hints(from_proto(build_turn_request("s", [], release=True))) == SessionHints(release=True)
    assert session_hints(from_proto(build_turn_request("s", [], release=False))) is None
    back = build_turn_request("s", [], pin_ttl_s=2.0, expected_return_s=6.5)
    assert session_hints(from_proto(back)) == SessionHints(pin_ttl_s=2.0, expected_return_s=6.5)
    with pytest.raises(ValueError):
        build_turn_request("s", [], pin_ttl_s=1.0, release=True)
    with pytest.raises(ValueError):
        build_turn_request("s", [], expected_return_s=1.0, release=True)
