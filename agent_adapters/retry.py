"""The client's errors and retry machinery: one deadline over a call's attempts, which failures are retried, backoff.

``_Attempts`` is the retry state of one logical call, shared by the sync and asyncio clients
(``agent_adapters.client``): each attempt is sent with what is left of the deadline, and a failed
attempt is either retried after a backoff or turned into a ``ChainKVError``. What is retried (see
the client's module docstring): UNAVAILABLE; ABORTED on a retry (the first attempt is still being
rolled back); and a busy session (ABORTED "a turn is already running") for every call, until the
deadline.
"""

from __future__ import annotations

import time
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from agent_adapters.call_settings import CallSettings
from sidecar._proto.chainkv.v1 import sidecar_pb2 as pb
from sidecar.session_ids import SESSION_HEADER

BUSY_DETAILS = "a turn is already running"
"""How the sidecar's ABORTED for a busy session begins (engine/chain/errors.py SessionBusy)."""


TURN_INDEX_CONFLICT_KEY = pb.TurnIndexConflict.DESCRIPTOR.full_name.lower() + "-bin"
"""Where a Turn refused for its expected_turn_index carries the session's real turn count (see the proto)."""


class ChainKVError(Exception):
    """A call failed; ``code`` is the gRPC status code (see the proto for what each means).
    ``session_turn_index``: on a Turn refused (FAILED_PRECONDITION) because its
    ``expected_turn_index`` is not the session's, the turns the session really holds; else None.
    Below the expectation, turns the client saw were lost (a crash under ``--durability async``, a
    store restored from older data): re-send the messages of the turns after it, with that index."""

    def __init__(self, code: grpc.StatusCode, details: str, attempts: int = 1, session_turn_index: int | None = None):
        super().__init__(f"{code.name}: {details}")
        self.code, self.details, self.attempts = code, details, attempts
        self.session_turn_index = session_turn_index


def session_turn_index(e: grpc.RpcError) -> int | None:
    """The ``TurnIndexConflict`` a failed call carries in its trailing metadata: the session's turn count."""
    trailing = getattr(e, "trailing_metadata", None)  # grpc.RpcError itself does not promise one (grpc.Call does)
    for key, value in (trailing() if trailing else None) or ():
        if key == TURN_INDEX_CONFLICT_KEY:
            try:
                return pb.TurnIndexConflict.FromString(value).session_turn_index
            except DecodeError:
                return None
    return None


class StreamDiverged(ChainKVError):
    """A retried Turn re-ran (its first attempt had been rolled back) and produced different text
    than the events already delivered; the session holds the new run's reply."""


def _retryable(code: grpc.StatusCode, attempt: int) -> bool:
    """Whether a failure of 0-based ``attempt`` with ``code`` may be retried (see the module docstring)."""
    return code is grpc.StatusCode.UNAVAILABLE or (code is grpc.StatusCode.ABORTED and attempt > 0)


def _busy(e: grpc.RpcError) -> bool:
    """The session had a turn running: the request was turned away before anything was done."""
    return e.code() is grpc.StatusCode.ABORTED and (e.details() or "").startswith(BUSY_DETAILS)


class _Attempts:
    """The retry state of one logical call, shared by the sync and asyncio clients: one deadline over all
    attempts (``timeout_s``, else the client's ``settings``), the options each attempt is sent with, and whether and
    after how long a failed attempt is retried (``repeatable``: the call may be sent again, i.e. a Turn
    with a request_id or an idempotent session RPC; the error is retryable; attempts and deadline left)."""

    def __init__(self, settings: CallSettings, timeout_s: float | None, repeatable: bool, session_id: str = ""):
        t = settings.timeout_s if timeout_s is None else timeout_s
        self.deadline = None if t is None else time.monotonic() + t
        self.policy, self.repeatable = settings.retry, repeatable
        self.metadata = settings.metadata + ((SESSION_HEADER, session_id),) if session_id else settings.metadata
        self.count = 0

    def next(self) -> dict[str, Any]:
        """Start an attempt: the stub call's keyword arguments (what is left of the deadline, the auth
        metadata and the session id header, and wait_for_ready on retries so a reconnecting channel is waited for)."""
        self.count += 1
        left = None if self.deadline is None else max(0.0, self.deadline - time.monotonic())
        return {"timeout": left, "metadata": self.metadata, "wait_for_ready": self.count > 1}

    def backoff_after(self, e: grpc.RpcError) -> float:
        """The seconds to wait before retrying the attempt that failed with ``e``; raises ChainKVError
        (with the number of attempts made) when ``e`` is final. A busy session (ABORTED, "a turn is
        already running") is retried whatever the call, since the server did nothing with it, until
        the deadline (or, without one, max_attempts)."""
        attempt = self.count - 1
        wait = None
        busy = _busy(e)
        if busy or (self.repeatable and _retryable(e.code(), attempt)):
            if attempt + 1 < self.policy.max_attempts or (busy and self.deadline is not None):
                wait = self.policy.backoff(attempt + 1)
            if wait is not None and self.deadline is not None and time.monotonic() + wait >= self.deadline:
                wait = None
        if wait is None:
            raise ChainKVError(e.code(), e.details() or "", self.count, session_turn_index(e)) from None
        return wait
