"""A Python client for the chainkv sidecar (``chainkv.v1.Sidecar``), sync and asyncio.

    with ChainKVClient("127.0.0.1:50051") as client:
        for event in client.stream_turn("run-42", [{"role": "user", "content": "Hi"}], max_tokens=64):
            ...                                  # TextDelta, ToolCall, then one TurnResult
        result = client.turn("run-42", [{"role": "user", "content": "And then?"}])

    async with AsyncChainKVClient("127.0.0.1:50051") as client:
        async for event in client.stream_turn(...):
            ...

Deadlines. ``timeout_s`` bounds a whole call, retries included; each attempt gets what is left as
its gRPC deadline, so the server stops (and rolls back) work nobody waits for any more.

Retries. Every Turn carries a ``request_id`` (a fresh one unless the caller gives one); a retry
sends the same id, so the server either replays the recorded result (``TurnResult.replayed``)
or, when the first attempt never finished (it was rolled back), runs the turn once. Retried:
UNAVAILABLE (a dropped connection, a replica shutting down, the store behind) and, on a retry,
ABORTED (the first attempt is still being rolled back). ABORTED "a turn is already running" (the
session is busy with another turn; the request was not started) is retried for every call, with
backoff, until the deadline. A stream that broke after some events
resumes without repeating them: the retried stream's text must extend what was delivered (it does
for a replay; a re-run that sampled differently raises ``StreamDiverged``). ``request_id=""``
turns replay off and with it retries.

Only the generated stubs are imported (no engine, no torch): ``pip install chainkv[client]``.
"""

from __future__ import annotations

import asyncio
import random
import time
import uuid
from dataclasses import dataclass
from typing import Any, AsyncIterator, Iterable, Iterator, Sequence

import grpc

from agent_adapters.messages import (
    ChatMessage,
    MessageLike,
    TextDelta,
    ToolCall,
    ToolLike,
    TurnEvent,
    TurnResult,
    as_message,
    as_tool,
)
from agent_adapters.output_format import OUTPUT_FIELDS, response_format_proto, tool_choice_proto
from sidecar._proto.chainkv.v1 import sidecar_pb2 as pb
from sidecar._proto.chainkv.v1 import sidecar_pb2_grpc

SAMPLING_FIELDS = (
    "max_tokens",
    "temperature",
    "top_k",
    "top_p",
    "seed",
    "stop",
    "ignore_eos",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
)
BUSY_DETAILS = "a turn is already running"
"""How the sidecar's ABORTED for a busy session begins (sidecar/sessions.py SessionBusy)."""
METHOD_FIELDS = ("method", "budget", "budget_ratio", "method_args", "shared_prefix_messages")


class ChainKVError(Exception):
    """A call failed; ``code`` is the gRPC status code (see the proto for what each means)."""

    def __init__(self, code: grpc.StatusCode, details: str, attempts: int = 1):
        super().__init__(f"{code.name}: {details}")
        self.code, self.details, self.attempts = code, details, attempts


class StreamDiverged(ChainKVError):
    """A retried Turn re-ran (its first attempt had been rolled back) and produced different text
    than the events already delivered; the session holds the new run's reply."""


@dataclass(frozen=True)
class RetryPolicy:
    max_attempts: int = 4
    initial_backoff_s: float = 0.1
    max_backoff_s: float = 2.0
    multiplier: float = 2.0

    def backoff(self, attempt: int) -> float:
        """Seconds to wait before attempt ``attempt`` (1-based retries), with jitter."""
        base = min(self.max_backoff_s, self.initial_backoff_s * self.multiplier ** (attempt - 1))
        return base * (0.5 + random.random() / 2)


def _retryable(code: grpc.StatusCode, attempt: int) -> bool:
    """Whether a failure of 0-based ``attempt`` with ``code`` may be retried (see the module docstring)."""
    return code is grpc.StatusCode.UNAVAILABLE or (code is grpc.StatusCode.ABORTED and attempt > 0)


def _busy(e: grpc.RpcError) -> bool:
    """The session had a turn running: the request was turned away before anything was done."""
    return e.code() is grpc.StatusCode.ABORTED and (e.details() or "").startswith(BUSY_DETAILS)


# session RPCs are safe to repeat except these two (a repeat would fork or prune twice)
_NOT_REPEATABLE = ("ForkSession", "PruneHistory")


class _Attempts:
    """The retry state of one logical call, shared by the sync and asyncio clients: one deadline over all
    attempts (``timeout_s``, else the client's), the options each attempt is sent with, and whether and
    after how long a failed attempt is retried (``repeatable``: the call may be sent again, i.e. a Turn
    with a request_id or an idempotent session RPC; the error is retryable; attempts and deadline left)."""

    def __init__(self, client: "_Base", timeout_s: float | None, repeatable: bool):
        t = client.timeout_s if timeout_s is None else timeout_s
        self.deadline = None if t is None else time.monotonic() + t
        self.policy, self.metadata, self.repeatable = client.retry, client.metadata, repeatable
        self.count = 0

    def next(self) -> dict[str, Any]:
        """Start an attempt: the stub call's keyword arguments (what is left of the deadline, the auth
        metadata, and wait_for_ready on retries so a reconnecting channel is waited for)."""
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
            raise ChainKVError(e.code(), e.details() or "", self.count) from None
        return wait


def _final_result(result: TurnResult | None) -> TurnResult:
    """The TurnResult a ``turn`` call collected, or INTERNAL when the stream had none."""
    if result is None:
        raise ChainKVError(grpc.StatusCode.INTERNAL, "the stream ended without a completion")
    return result


def build_turn_request(
    session_id: str,
    messages: Iterable[MessageLike],
    *,
    tools: Sequence[ToolLike] = (),
    request_id: str | None = None,
    expected_turn_index: int | None = None,
    **options: Any,
) -> pb.TurnRequest:
    """A TurnRequest; ``options`` are the sampling fields (max_tokens, temperature, top_k, top_p,
    seed, stop, ignore_eos, presence_penalty, frequency_penalty, repetition_penalty) and the session's method fields (method, budget, budget_ratio,
    method_args, shared_prefix_messages) and the output fields (response_format, tool_choice: see
    ``agent_adapters.output_format``). None values are left unset (the server's defaults)."""
    unknown = set(options) - set(SAMPLING_FIELDS) - set(METHOD_FIELDS) - set(OUTPUT_FIELDS)
    if unknown:
        raise TypeError(
            f"unknown Turn option(s) {sorted(unknown)}; known: {SAMPLING_FIELDS + METHOD_FIELDS + OUTPUT_FIELDS}"
        )
    req = pb.TurnRequest(
        session_id=session_id,
        request_id=uuid.uuid4().hex if request_id is None else request_id,
        messages=[as_message(m).to_proto() for m in messages],
        tools=[as_tool(t).to_proto() for t in tools],
    )
    if expected_turn_index is not None:
        req.expected_turn_index = expected_turn_index
    for key, value in options.items():
        if value is None:
            continue
        if key == "stop":
            req.stop.extend([value] if isinstance(value, str) else value)
        elif key == "method_args":
            req.method_args.update({k: str(v) for k, v in value.items()})
        elif key == "response_format":
            req.response_format.CopyFrom(response_format_proto(value))
        elif key == "tool_choice":
            req.tool_choice.CopyFrom(tool_choice_proto(value))
        else:
            setattr(req, key, value)
    return req


class _Resume:
    """Delivers each event once across retried attempts of one streamed Turn."""

    def __init__(self) -> None:
        self.text, self.tokens, self.calls = "", [], []
        self.attempts = 0

    def new_attempt(self) -> None:
        self.attempts += 1
        self._text, self._tokens, self._calls = "", [], 0

    def feed(self, event: pb.TurnEvent) -> list[TurnEvent]:
        kind = event.WhichOneof("event")
        if kind == "delta":
            self._text += event.delta.text
            self._tokens += event.delta.token_ids
            text = self._extend("text", self._text)
            tokens = self._extend("tokens", self._tokens)
            return [TextDelta(text, tuple(tokens))] if text or tokens else []
        if kind == "tool_call":
            call = ToolCall.from_proto(event.tool_call)
            k, self._calls = self._calls, self._calls + 1
            if k < len(self.calls):
                if (self.calls[k].name, self.calls[k].arguments) != (call.name, call.arguments):
                    raise StreamDiverged(
                        grpc.StatusCode.DATA_LOSS, "the retried turn made a different tool call", self.attempts
                    )
                return []
            self.calls.append(call)
            return [call]
        result = TurnResult.from_proto(event.completion, self.attempts)
        self._extend("text", result.text)
        return [result]

    def _extend(self, what: str, attempt_value):
        """The part of this attempt's cumulative ``what`` not delivered yet (checking they agree)."""
        delivered = self.text if what == "text" else self.tokens
        n = len(delivered)
        if len(attempt_value) <= n:
            ok, new = delivered[: len(attempt_value)] == attempt_value, attempt_value[:0]
        else:
            ok, new = attempt_value[:n] == delivered, attempt_value[n:]
        if not ok:
            raise StreamDiverged(
                grpc.StatusCode.DATA_LOSS,
                "the retried turn re-ran and its reply differs from the part already delivered",
                self.attempts,
            )
        if len(new):
            if what == "text":
                self.text = attempt_value
            else:
                self.tokens = list(attempt_value)
        return new


def _channel_options(max_message_bytes: int) -> list[tuple[str, Any]]:
    return [
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.initial_reconnect_backoff_ms", 100),
        ("grpc.min_reconnect_backoff_ms", 100),
        ("grpc.max_reconnect_backoff_ms", 2000),
    ]


class _Base:
    def __init__(
        self,
        target: str,
        token: str | None,
        tls_ca: str | None,
        timeout_s: float | None,
        retry: RetryPolicy | None,
        max_message_bytes: int,
    ):
        self.target = target
        self.metadata = (("authorization", f"Bearer {token}"),) if token else ()
        self.timeout_s = timeout_s
        self.retry = retry or RetryPolicy()
        self._tls_ca = tls_ca
        self._options = _channel_options(max_message_bytes)

    def _credentials(self):
        if self._tls_ca is None:
            return None
        with open(self._tls_ca, "rb") as f:
            return grpc.ssl_channel_credentials(f.read())

    def _turn_attempts(self, req: pb.TurnRequest, timeout_s: float | None) -> _Attempts:
        """A Turn is retried only with a request_id (the server then replays instead of running twice)."""
        return _Attempts(self, timeout_s, repeatable=bool(req.request_id))

    def _unary_attempts(self, method: str, timeout_s: float | None) -> _Attempts:
        return _Attempts(self, timeout_s, repeatable=method not in _NOT_REPEATABLE)


class ChainKVClient(_Base):
    """Blocking client. Thread-safe (one gRPC channel)."""

    def __init__(
        self,
        target: str = "127.0.0.1:50051",
        *,
        token: str | None = None,
        tls_ca: str | None = None,
        timeout_s: float | None = 300.0,
        retry: RetryPolicy | None = None,
        max_message_bytes: int = 4 * 2**20,
    ):
        super().__init__(target, token, tls_ca, timeout_s, retry, max_message_bytes)
        creds = self._credentials()
        self.channel = (
            grpc.secure_channel(target, creds, options=self._options)
            if creds is not None
            else grpc.insecure_channel(target, options=self._options)
        )
        self.stub = sidecar_pb2_grpc.SidecarStub(self.channel)

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> "ChainKVClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # --- Turn ----------------------------------------------------------------------------------
    def stream_turn(
        self,
        session_id: str,
        messages: Iterable[MessageLike],
        *,
        tools: Sequence[ToolLike] = (),
        request_id: str | None = None,
        expected_turn_index: int | None = None,
        timeout_s: float | None = None,
        **options: Any,
    ) -> Iterator[TurnEvent]:
        """Run one turn, yielding TextDelta and ToolCall events as they arrive, then the TurnResult."""
        req = build_turn_request(
            session_id, messages, tools=tools, request_id=request_id, expected_turn_index=expected_turn_index, **options
        )
        return self._stream(req, self._turn_attempts(req, timeout_s))

    def _stream(self, req: pb.TurnRequest, attempts: _Attempts) -> Iterator[TurnEvent]:
        resume = _Resume()
        while True:
            resume.new_attempt()
            call = self.stub.Turn(req, **attempts.next())
            try:
                for event in call:
                    yield from resume.feed(event)
                return
            except grpc.RpcError as e:
                time.sleep(attempts.backoff_after(e))
            finally:
                call.cancel()  # a consumer that stops early cancels the turn (the server rolls it back)

    def turn(self, session_id: str, messages: Iterable[MessageLike], **kw: Any) -> TurnResult:
        """Run one turn and return its result (the same arguments as ``stream_turn``)."""
        result = None
        for event in self.stream_turn(session_id, messages, **kw):
            if isinstance(event, TurnResult):
                result = event
        return _final_result(result)

    # --- sessions ------------------------------------------------------------------------------
    def _unary(self, method: str, request, timeout_s: float | None):
        attempts = self._unary_attempts(method, timeout_s)
        while True:
            try:
                return getattr(self.stub, method)(request, **attempts.next())
            except grpc.RpcError as e:
                time.sleep(attempts.backoff_after(e))

    def get_session(self, session_id: str, timeout_s: float | None = None) -> pb.Session:
        return self._unary("GetSession", pb.GetSessionRequest(session_id=session_id), timeout_s)

    def resume(
        self, session_id: str, expected_turn_index: int | None = None, timeout_s: float | None = None
    ) -> pb.Session:
        req = pb.ResumeRequest(session_id=session_id)
        if expected_turn_index is not None:
            req.expected_turn_index = expected_turn_index
        return self._unary("Resume", req, timeout_s)

    def end_session(
        self, session_id: str, keep_snapshot: bool = False, timeout_s: float | None = None
    ) -> pb.EndSessionResponse:
        return self._unary(
            "EndSession", pb.EndSessionRequest(session_id=session_id, keep_snapshot=keep_snapshot), timeout_s
        )

    def fork_session(self, session_id: str, new_session_id: str, timeout_s: float | None = None) -> pb.Session:
        return self._unary(
            "ForkSession", pb.ForkSessionRequest(session_id=session_id, new_session_id=new_session_id), timeout_s
        )

    def prune_history(self, request: pb.PruneHistoryRequest, timeout_s: float | None = None) -> pb.PruneHistoryResponse:
        return self._unary("PruneHistory", request, timeout_s)

    def server_info(self, timeout_s: float | None = None) -> pb.ServerInfo:
        return self._unary("GetServerInfo", pb.GetServerInfoRequest(), timeout_s)


class AsyncChainKVClient(_Base):
    """asyncio client (grpc.aio); create and use it on one event loop."""

    def __init__(
        self,
        target: str = "127.0.0.1:50051",
        *,
        token: str | None = None,
        tls_ca: str | None = None,
        timeout_s: float | None = 300.0,
        retry: RetryPolicy | None = None,
        max_message_bytes: int = 4 * 2**20,
    ):
        super().__init__(target, token, tls_ca, timeout_s, retry, max_message_bytes)
        creds = self._credentials()
        self.channel = (
            grpc.aio.secure_channel(target, creds, options=self._options)
            if creds is not None
            else grpc.aio.insecure_channel(target, options=self._options)
        )
        self.stub = sidecar_pb2_grpc.SidecarStub(self.channel)

    async def close(self) -> None:
        await self.channel.close()

    async def __aenter__(self) -> "AsyncChainKVClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def stream_turn(
        self,
        session_id: str,
        messages: Iterable[MessageLike],
        *,
        tools: Sequence[ToolLike] = (),
        request_id: str | None = None,
        expected_turn_index: int | None = None,
        timeout_s: float | None = None,
        **options: Any,
    ) -> AsyncIterator[TurnEvent]:
        req = build_turn_request(
            session_id, messages, tools=tools, request_id=request_id, expected_turn_index=expected_turn_index, **options
        )
        attempts = self._turn_attempts(req, timeout_s)
        resume = _Resume()
        while True:
            resume.new_attempt()
            call = self.stub.Turn(req, **attempts.next())
            try:
                async for event in call:
                    for out in resume.feed(event):
                        yield out
                return
            except grpc.RpcError as e:
                await asyncio.sleep(attempts.backoff_after(e))
            finally:
                call.cancel()

    async def turn(self, session_id: str, messages: Iterable[MessageLike], **kw: Any) -> TurnResult:
        result = None
        async for event in self.stream_turn(session_id, messages, **kw):
            if isinstance(event, TurnResult):
                result = event
        return _final_result(result)

    async def _unary(self, method: str, request, timeout_s: float | None):
        attempts = self._unary_attempts(method, timeout_s)
        while True:
            try:
                return await getattr(self.stub, method)(request, **attempts.next())
            except grpc.RpcError as e:
                await asyncio.sleep(attempts.backoff_after(e))

    async def get_session(self, session_id: str, timeout_s: float | None = None) -> pb.Session:
        return await self._unary("GetSession", pb.GetSessionRequest(session_id=session_id), timeout_s)

    async def end_session(
        self, session_id: str, keep_snapshot: bool = False, timeout_s: float | None = None
    ) -> pb.EndSessionResponse:
        return await self._unary(
            "EndSession", pb.EndSessionRequest(session_id=session_id, keep_snapshot=keep_snapshot), timeout_s
        )

    async def prune_history(
        self, request: pb.PruneHistoryRequest, timeout_s: float | None = None
    ) -> pb.PruneHistoryResponse:
        return await self._unary("PruneHistory", request, timeout_s)

    async def server_info(self, timeout_s: float | None = None) -> pb.ServerInfo:
        return await self._unary("GetServerInfo", pb.GetServerInfoRequest(), timeout_s)


__all__ = [
    "AsyncChainKVClient",
    "ChainKVClient",
    "ChainKVError",
    "ChatMessage",
    "RetryPolicy",
    "StreamDiverged",
    "TextDelta",
    "ToolCall",
    "TurnResult",
    "build_turn_request",
]
