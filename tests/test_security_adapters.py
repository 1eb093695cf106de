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


def _conversation(turns: int) -> tuple[SessionLedger, list[ChatMessage]]:
    """A ledger that recorded ``turns`` turns of one conversation, and that conversation plus the next user message."""
    ledger = SessionLedger()
    history = [ChatMessage("system", "be brief"), ChatMessage("user", "q0")]
    for i in range(turns):
        ledger.record(ledger.plan("thread", history), result(i, f"a{i}"))
        history = history + [ChatMessage("assistant", f"a{i}"), ChatMessage("user", f"q{i + 1}")]
    return ledger, history


def test_a_session_that_lost_turns_is_caught_up_with_the_messages_after_those_it_holds():
    """Issue 30: the sidecar says the session holds fewer turns than recorded (lost to a crash or a
    rollback); the catch-up turn re-sends every message after them, at the index the session is at."""
    ledger, history = _conversation(3)
    plan = ledger.plan("thread", history)
    assert plan.expected_turn_index == 3 and [m.content for m in plan.messages] == ["q3"]
    again = ledger.recover(plan, history, 1)
    assert again.expected_turn_index == 1 and not again.first and again.session_id == plan.session_id
    assert [m.content for m in again.messages] == ["q1", "a1", "q2", "a2", "q3"]
    assert Conversations._options(again, (), {"max_tokens": 4, "method": "h2o"}) == {
        "max_tokens": 4,
        "tools": [],
        "expected_turn_index": 1,
    }
    ledger.record(again, result(1, "a3"))  # the catch-up turn is the session's turn 1
    later = history + [ChatMessage("assistant", "a3"), ChatMessage("user", "q4")]
    nxt = ledger.plan("thread", later)
    assert nxt.expected_turn_index == 2 and [m.content for m in nxt.messages] == ["q4"]
    # losing the catch-up turn too: back to the messages after turn 1 of the original conversation
    assert [m.content for m in ledger.recover(nxt, later, 1).messages] == ["q1", "a1", "q2", "a2", "q3", "a3", "q4"]


def test_a_session_that_lost_everything_is_sent_the_whole_conversation_as_a_first_turn():
    ledger, history = _conversation(2)
    plan = ledger.plan("thread", history)
    again = ledger.recover(plan, history, 0)
    assert again.first and again.expected_turn_index == 0 and again.messages == history
    assert Conversations._options(again, ["tool"], {"method": "h2o"})["tools"] == ["tool"]  # tools and method again


def test_only_a_session_behind_the_ledger_is_caught_up():
    ledger, history = _conversation(2)
    plan = ledger.plan("thread", history)
    assert ledger.recover(plan, history, 2) is None  # where the ledger expects it: another refusal
    assert ledger.recover(plan, history, 3) is None  # ahead: another writer, not a loss
    assert ledger.recover(plan, history, -1) is None


def test_the_client_reads_the_session_turn_index_from_a_refusal_trailer():
    import grpc

    from agent_adapters.retry import TURN_INDEX_CONFLICT_KEY, session_turn_index
    from sidecar._proto.chainkv.v1 import sidecar_pb2 as pb

    class Refused(grpc.RpcError):
        def __init__(self, trailer):
            self.trailer = trailer

        def trailing_metadata(self):
            return self.trailer

    detail = pb.TurnIndexConflict(session_turn_index=4, expected_turn_index=6).SerializeToString()
    assert session_turn_index(Refused(((TURN_INDEX_CONFLICT_KEY, detail),))) == 4
    assert session_turn_index(Refused(((TURN_INDEX_CONFLICT_KEY, b"\xff\xff"),))) is None  # garbage: unknown
    assert session_turn_index(Refused(None)) is None
    assert session_turn_index(grpc.RpcError()) is None
