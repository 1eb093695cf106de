"""``chainkv demo`` against a real sidecar on a tiny random model: the forced tool choice makes every
tool question a real tool round trip (a well-formed call, the tool run, its result sent back), and
later turns reuse the session's cached KV."""

from __future__ import annotations

import io
import re

import pytest


@pytest.fixture(scope="module")
def target(tiny_chat_server):
    return f"127.0.0.1:{tiny_chat_server.server.port}", tiny_chat_server


def test_the_demo_makes_real_tool_round_trips_and_shows_reuse(target):
    from sidecar.cli.demo import run_demo, run_tool

    address, server = target
    out = io.StringIO()
    assert run_demo(address, "demo-1", max_tokens=8, out=out) == 0
    text = out.getvalue()
    assert "-> tool call: calculator(" in text and "-> tool call: clock(" in text
    assert "<- calculator returned: " in text and "<- clock returned: It is " in text
    assert "2 tool round trip(s)" in text and "session: 5 turns" in text
    reused = int(re.search(r"after the first turn, (\d+) context tokens came from the session's KV", text).group(1))
    assert reused > 0 and text.count("KV in device memory") == 4
    assert server.server.sessions.local("demo-1") is None  # ended
    assert run_tool("calculator", '{"expression": "37 * 41"}').startswith("37 * 41 = 1517.")
    assert run_tool("calculator", '{"expression": "(("}').startswith("(( = error")
