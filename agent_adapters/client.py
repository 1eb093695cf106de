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

Lost turns. A Turn whose ``expected_turn_index`` is ahead of every copy of its session (turns
acknowledged under ``--durability async`` and lost to a crash, a store restored from older data)
raises ``ChainKVError`` FAILED_PRECONDITION with ``session_turn_index``, the turns the session
holds: send every message after them again, with that index (``agent_adapters.conversation`` does).

Routing. Every session call carries its session id as ``x-session-id`` metadata, which a proxy in
front of a pool of replicas hashes on to keep the session on the replica holding its KV
(docs/deploy.md).

The settings of every call (metadata, deadline, retry policy) live in ``agent_adapters.call_settings``,
the retry machinery and errors in ``agent_adapters.retry``, the TurnRequest and the stream's
resumption in ``agent_adapters.turns``; their public names are importable from here too.

Only the generated stubs are imported (no engine, no torch): ``pip install chainkv[client]``.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, AsyncIterator, Iterable, Iterator, Sequence

import grpc

from agent_adapters.call_settings import CallSettings, RetryPolicy
from agent_adapters.messages import ChatMessage, MessageLike, TextDelta, ToolCall, ToolLike, TurnEvent, TurnResult
from agent_adapters.retry import ChainKVError, StreamDiverged, _Attempts
from agent_adapters.turns import HINT_FIELDS, METHOD_FIELDS, SAMPLING_FIELDS, _Resume, build_turn_request
from sidecar._proto.chainkv.v1 import sidecar_pb2 as pb
from sidecar._proto.chainkv.v1 import sidecar_pb2_grpc

# session RPCs are safe to repeat except these two (a repeat would fork or prune twice)
_NOT_REPEATABLE = ("ForkSession", "PruneHistory")


def _final_result(result: TurnResult | None) -> TurnResult:
    """The TurnResult a ``turn`` call collected, or INTERNAL when the stream had none."""
    if result is None:
        raise ChainKVError(grpc.StatusCode.INTERNAL, "the stream ended without a completion")
    return result


def _channel_options(max_message_bytes: int) -> list[tuple[str, Any]]:
    return [
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.initial_reconnect_backoff_ms", 100),
        ("grpc.min_reconnect_backoff_ms", 100),
        ("grpc.max_reconnect_backoff_ms", 2000),
    ]


class _Base:
    """What both clients share: the settings of every call (``settings``: auth metadata, deadline, retry
    policy) and one channel to ``target`` with its stub, opened with ``channels`` (``grpc`` or ``grpc.aio``)."""

    def __init__(
        self,
        channels: Any,
        target: str,
        token: str | None,
        tls_ca: str | None,
        timeout_s: float | None,
        retry: RetryPolicy | None,
        max_message_bytes: int,
    ):
        self.target = target
        self.settings = CallSettings(
            metadata=(("authorization", f"Bearer {token}"),) if token else (),
            timeout_s=timeout_s,
            retry=retry or RetryPolicy(),
        )
        options = _channel_options(max_message_bytes)
        if tls_ca is None:
            self.channel = channels.insecure_channel(target, options=options)
        else:
            with open(tls_ca, "rb") as f:
                creds = grpc.ssl_channel_credentials(f.read())
            self.channel = channels.secure_channel(target, creds, options=options)
        self.stub = sidecar_pb2_grpc.SidecarStub(self.channel)

    def _turn_attempts(self, req: pb.TurnRequest, timeout_s: float | None) -> _Attempts:
        """A Turn is retried only with a request_id (the server then replays instead of running twice)."""
        return _Attempts(self.settings, timeout_s, repeatable=bool(req.request_id), session_id=req.session_id)

    def _unary_attempts(self, method: str, request, timeout_s: float | None) -> _Attempts:
        """Every session RPC sends its session id as ``x-session-id`` metadata (a pool's proxy routes on it)."""
        return _Attempts(
            self.settings,
            timeout_s,
            repeatable=method not in _NOT_REPEATABLE,
            session_id=getattr(request, "session_id", ""),
        )


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
        super().__init__(grpc, target, token, tls_ca, timeout_s, retry, max_message_bytes)

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
        attempts = self._unary_attempts(method, request, timeout_s)
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
        super().__init__(grpc.aio, target, token, tls_ca, timeout_s, retry, max_message_bytes)

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
        attempts = self._unary_attempts(method, request, timeout_s)
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
    "HINT_FIELDS",
    "METHOD_FIELDS",
    "SAMPLING_FIELDS",
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
