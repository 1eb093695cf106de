"""SidecarService: the ``chainkv.v1.Sidecar`` servicer, requests in, status codes out.

Each RPC checks the caller (auth, draining, a failed engine), scopes the session id by tenant,
and hands the work to the piece that owns it: ``TurnRunner`` for Turn, ``SessionManager`` for
finding, loading and ending sessions and for everything in the store, ``EngineClient`` for engine
state. Every exception leaves
through ``sidecar.grpc.errors.status_for``; ``ServerHooks.on_rpc`` sees each call's final code.

A request whose bytes do not parse as its message gets INVALID_ARGUMENT (the deserializer hands
the handler a ``BadMessage`` instead of failing inside gRPC, which would answer INTERNAL).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from typing import Callable

import grpc
from google.protobuf.message import DecodeError

from engine.api import METHODS, PruneRuleError, SessionExists, SessionInfo, SessionNotFound, check_policy, check_span
from sidecar._proto.chainkv.v1 import sidecar_pb2 as pb
from sidecar.engine_bridge.client import EngineClient, PruneSpec
from sidecar.grpc.endpoint import SERVICE
from sidecar.grpc.errors import Draining, status_for, trailing_metadata_for
from sidecar.grpc.logs import bind_request
from sidecar.grpc.options import ServerOptions
from sidecar.session_ids import BadSessionId, check_id, scoped_key
from sidecar.sessions.manager import SessionManager
from sidecar.sessions.record import Session
from sidecar.turns.hooks import ServerHooks
from sidecar.turns.protocol import InvalidRequest, session_proto, stored_session_proto
from sidecar.turns.prune import prune_session
from sidecar.turns.request import from_proto
from sidecar.turns.runner import TurnRunner

log = logging.getLogger(__name__)


class BadMessage:
    """A request that failed to parse (e.g. invalid UTF-8 in a string field)."""

    def __init__(self, error: str):
        self.error = error


def _parser(cls):
    def parse(data: bytes):
        try:
            return cls.FromString(data)
        except DecodeError as e:
            return BadMessage(str(e))

    return parse


class SidecarService:
    """The ``chainkv.v1.Sidecar`` servicer."""

    def __init__(
        self,
        *,
        client: EngineClient,
        sessions: SessionManager,
        turns: TurnRunner,
        options: ServerOptions,
        hooks: ServerHooks,
        draining: Callable[[], bool],
    ):
        self.client = client
        self.sessions = sessions
        self.opts = options
        self.hooks = hooks
        self.draining = draining
        self.turns = turns

    # --- plumbing ------------------------------------------------------------------------------------
    def handlers(self) -> grpc.GenericRpcHandler:
        def unary(fn, req, resp):
            return grpc.unary_unary_rpc_method_handler(
                fn, request_deserializer=_parser(req), response_serializer=resp.SerializeToString
            )

        return grpc.method_handlers_generic_handler(
            SERVICE,
            {
                "Turn": grpc.unary_stream_rpc_method_handler(
                    self.Turn,
                    request_deserializer=_parser(pb.TurnRequest),
                    response_serializer=pb.TurnEvent.SerializeToString,
                ),
                "Resume": unary(self.Resume, pb.ResumeRequest, pb.Session),
                "EndSession": unary(self.EndSession, pb.EndSessionRequest, pb.EndSessionResponse),
                "GetSession": unary(self.GetSession, pb.GetSessionRequest, pb.Session),
                "ForkSession": unary(self.ForkSession, pb.ForkSessionRequest, pb.Session),
                "PruneHistory": unary(self.PruneHistory, pb.PruneHistoryRequest, pb.PruneHistoryResponse),
                "GetServerInfo": unary(self.GetServerInfo, pb.GetServerInfoRequest, pb.ServerInfo),
            },
        )

    def _begin(self, request, context) -> str:
        """Common checks; returns the caller's tenant."""
        if isinstance(request, BadMessage):
            raise InvalidRequest(f"the request could not be parsed: {request.error}")
        tenant = self.opts.auth.tenant(context.invocation_metadata())
        bind_request(tenant, getattr(request, "session_id", ""))
        if self.draining():
            raise Draining("the sidecar is shutting down; retry on another replica")
        self.client.check_serving()
        return tenant

    @staticmethod
    def _deadline(context) -> float | None:
        left = context.time_remaining()
        return None if left is None else time.monotonic() + left

    async def _unary(self, name: str, fn, request, context):
        t0 = time.monotonic()
        try:
            reply = await fn(request, context)
        except Exception as e:
            code = status_for(e)
            if code is grpc.StatusCode.INTERNAL:
                log.exception("%s failed", name)
            self.hooks.on_rpc(name, code, time.monotonic() - t0)
            await context.abort(code, str(e) or type(e).__name__, trailing_metadata_for(e))
        self.hooks.on_rpc(name, grpc.StatusCode.OK, time.monotonic() - t0)
        return reply

    def _session_proto(self, session_id: str, info: SessionInfo, s: Session | None) -> pb.Session:
        return session_proto(session_id, info, s, _tier(s, info) if s is not None else None, self.sessions.has_store)

    # --- Turn --------------------------------------------------------------------------------------------
    async def Turn(self, request, context):
        """Written with ``context.write``, not as an async generator: grpc cancels this coroutine
        when the client goes away, also while an event is being sent, and the turn's events are
        closed (rolled back) at once. An async-generator handler cancelled there is left suspended
        and its turn held until the generator is garbage-collected."""
        t0 = time.monotonic()
        code = grpc.StatusCode.CANCELLED
        try:
            tenant = self._begin(request, context)
            turn = self.turns.run(tenant, from_proto(request), self._deadline(context))
            async with contextlib.aclosing(turn) as events:
                async for event in events:
                    await context.write(event)
            code = grpc.StatusCode.OK
        except grpc.aio.BaseError:  # grpc's own (a write to a client that left, a stopped server): it handles them
            raise
        except Exception as e:
            code = status_for(e)
            if code is grpc.StatusCode.INTERNAL:
                log.exception("Turn failed")
            await context.abort(code, str(e) or type(e).__name__, trailing_metadata_for(e))
        finally:
            self.hooks.on_rpc("Turn", code, time.monotonic() - t0)

    # --- sessions ------------------------------------------------------------------------------------------
    async def Resume(self, request, context):
        return await self._unary("Resume", self._resume, request, context)

    async def _resume(self, request, context):
        tenant = self._begin(request, context)
        key = scoped_key(tenant, request.session_id)
        expected = request.expected_turn_index if request.HasField("expected_turn_index") else None
        self.turns.check_quota(tenant, key)
        s = await self.sessions.get(key, create=False, expected_turn_index=expected, deadline=self._deadline(context))
        if not s.in_engine:
            raise SessionNotFound(f"no session {request.session_id!r}")
        return self._session_proto(request.session_id, await self.client.session_info(key), s)

    async def GetSession(self, request, context):
        return await self._unary("GetSession", self._get_session, request, context)

    async def _get_session(self, request, context):
        tenant = self._begin(request, context)
        key = scoped_key(tenant, request.session_id)
        s = self.sessions.local(key)
        if s is not None and s.in_engine:
            info = await self.client.session_info(key)
            if s.busy:  # a turn is taking it (being rendered, or rolled back)
                info = dataclasses.replace(info, state="active")
            return self._session_proto(request.session_id, info, s)
        stored = await self.sessions.stored(key)
        if stored is not None:
            return stored_session_proto(request.session_id, stored.record)
        raise SessionNotFound(f"no session {request.session_id!r}")

    async def EndSession(self, request, context):
        return await self._unary("EndSession", self._end_session, request, context)

    async def _end_session(self, request, context):
        tenant = self._begin(request, context)
        key = scoped_key(tenant, request.session_id)
        here, deleted = await self.sessions.end(key, request.keep_snapshot)
        return pb.EndSessionResponse(ended_here=here, deleted_from_store=deleted)

    async def ForkSession(self, request, context):
        return await self._unary("ForkSession", self._fork, request, context)

    async def _fork(self, request, context):
        tenant = self._begin(request, context)
        key = scoped_key(tenant, request.session_id)
        try:
            check_id(request.new_session_id, "new_session_id")
        except BadSessionId as e:
            raise InvalidRequest(str(e)) from None
        child_key = scoped_key(tenant, request.new_session_id)
        parent = await self.sessions.get_settled(key, create=False, deadline=self._deadline(context))
        if not parent.in_engine:
            raise SessionNotFound(f"no session {request.session_id!r}")
        existing = self.sessions.local(child_key)
        if existing is not None and (existing.in_engine or existing.busy):
            raise SessionExists(f"session {request.new_session_id!r} already exists")
        if await self.sessions.stored(child_key) is not None:
            raise SessionExists(f"session {request.new_session_id!r} already exists (in the store)")
        self.opts.tenant_limits.check_new_session(tenant, self.sessions.all(), exclude=child_key)
        running = self.sessions.begin_turn(parent, "")
        try:
            info = await self.client.fork(key, child_key)
        finally:
            self.sessions.end_turn(parent, running, None)
        child = self.sessions.adopt(child_key, tools_digest=parent.tools_digest, info=info, tools=parent.tools)
        self.sessions.mark_dirty(child_key)
        return session_proto(request.new_session_id, info, child, has_store=self.sessions.has_store)

    async def PruneHistory(self, request, context):
        return await self._unary("PruneHistory", self._prune, request, context)

    async def _prune(self, request, context):
        tenant = self._begin(request, context)
        key = scoped_key(tenant, request.session_id)
        keep = request.prune_keep_ratio if request.HasField("prune_keep_ratio") else None
        spec = PruneSpec(
            span=(request.start, request.end) if request.end else None,
            roles=tuple(request.prune_roles),
            lag=request.prune_lag if request.HasField("prune_lag") else None,
            policy=request.prune_policy or None,
            keep_ratio=keep,
            scope=request.prune_scope or None,
        )
        try:  # the engine's rule, checked before the session is looked up
            check_policy(spec.policy, spec.keep_ratio, spec.scope)
            if spec.span is not None:
                check_span(*spec.span)
        except PruneRuleError as e:
            raise InvalidRequest(str(e)) from None
        result = await prune_session(
            self.sessions,
            self.client,
            key,
            [spec],
            hooks=self.hooks,
            deadline=self._deadline(context),
        )
        s = self.sessions.local(key)
        return pb.PruneHistoryResponse(
            removed=result.removed,
            pruned_tokens=result.pruned_tokens,
            session=session_proto(request.session_id, result.session, s, has_store=self.sessions.has_store),
        )

    async def GetServerInfo(self, request, context):
        return await self._unary("GetServerInfo", self._server_info, request, context)

    async def _server_info(self, request, context):
        self._begin(request, context)
        m = self.client.model
        return pb.ServerInfo(
            model=m.name,
            architecture=m.architecture,
            max_model_len=m.max_model_len,
            default_max_tokens=self.opts.limits.default_max_tokens,
            method=m.method,
            methods=sorted(METHODS),
            vocab_size=m.vocab_size,
        )


def _tier(s: Session, info: SessionInfo) -> str | None:
    """Where the session's next turn would find it (a loaded snapshot counts as the store)."""
    if info.state == "host" and s.source_tier in ("store", "recompute"):
        return s.source_tier
    return None  # session_proto derives it from the state
