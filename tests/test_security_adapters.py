"""The adapters send ``expected_turn_index`` (issue 18, class 6): a turn lost to a crash surfaces as
FAILED_PRECONDITION instead of the next turn silently taking its index."""

from __future__ import annotations

from agent_adapters.conversation import Conversations
from agent_adapters.ledger import SessionLedger
from agent_adapters.messages import ChatMessage, TurnResult, Usage


def result(turn_index: int, text: str = "ok") -> TurnResult:
    return TurnResult("s", "r", turn_index, turn_index + 1, "stop", text, (), (), Usage(), False)


def test_each_planned_turn_carries_the_index_the_session_should_be_at():
    ledger = SessionLedger()
    history = [ChatMessage("user", "hi")]
    for i in range(4):
        plan = ledger.plan("thread", history)
        assert plan.expected_turn_index == i
        opts = Conversations._options(plan, (), {"max_tokens": 4})
        assert opts["expected_turn_index"] == i
        ledger.record(plan, result(i, f"reply {i}"))
        history = history + [ChatMessage("assistant", f"reply {i}"), ChatMessage("user", f"more {i}")]
    # an edited history moves to a fresh session, which starts at turn 0
    fresh = ledger.plan("thread", [ChatMessage("user", "something else")])
    assert fresh.first and fresh.expected_turn_index == 0
    assert Conversations._options(fresh, (), {})["expected_turn_index"] == 0
