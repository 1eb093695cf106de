"""The gRPC sidecar: ``chainkv.v1.Sidecar`` on grpc.aio, the engine stepping on a thread beside it.

    server = SidecarServer(engine, ServerOptions(port=50051), open_store("redis://localhost:6379"))
    port = await server.start()
    ...
    await server.stop()          # health NOT_SERVING, drain running turns, flush snapshots

Pieces: ``EngineLoop`` (engine thread), ``SessionManager`` (session id -> chain, ordering,
idempotency, loading from the store), ``SnapshotWriter`` (write-behind snapshots), ``ChatRenderer``
and ``ToolCallParser`` (chat in, tool calls out), ``Authenticator`` (bearer token -> tenant). The
servicer here maps requests onto them and exceptions onto status codes (``status_for``), and
calls ``ServerHooks`` at each RPC, turn and snapshot so metrics can attach without touching it.

A Turn's life: validate -> find or load the session -> replay if its request_id is recorded ->
take the session -> render the new messages -> ``add_turn`` on the engine thread -> stream
deltas and tool calls as outputs arrive -> record the completion -> mark the session dirty for
the snapshot writer. A client that cancels, or whose deadline passes, makes the engine abort the
turn, which rolls it back (``ChainCache.abort_turn``); the session is released once the engine
has done so.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from engine.chain import (ContextFull, SessionBusy, SessionError, SessionExists, SessionNotFound)
from engine.config import ConfigError
from engine.constrained import ConstraintError
from engine.lifecycle import MethodError
from engine.methods import REGISTRY as METHODS
from engine.llm import CapacityError, LLMEngine, RequestError
from engine.model.loader import load_tokenizer
from engine.sampling import SamplingError
from engine.sequence import RequestOutput
from sidecar._proto.chainkv.v1 import sidecar_pb2 as pb
from sidecar.auth import Authenticator, Unauthenticated
from sidecar.chat import ChatError, ChatRenderer, tools_digest
from sidecar.engine_loop import EngineFailed, EngineLoop
from sidecar.integrity import SnapshotRejected
from sidecar.limits import QuotaExceeded, TenantLimits, TurnTooLarge
from sidecar.logs import bind_request
from sidecar.protocol import (FINISH, TIERS, InvalidRequest, Limits, parse_turn, session_proto,
                              stored_session_proto, tool_call_proto)
from sidecar.sessions import BadSessionId, Session, SessionManager, check_id, scoped_key
from sidecar.snapshots import SnapshotWriter
from sidecar.structured import OutputSpecError, tools_from_meta
from sidecar.store import SessionStore, StoreUnavailable
from sidecar.tool_calls import PlainText, ToolCallParser

log = logging.getLogger(__name__)

SERVICE = pb.DESCRIPTOR.services_by_name["Sidecar"].full_name  # "chainkv.v1.Sidecar"


class Draining(RuntimeError):
    """The server is shutting down (UNAVAILABLE: retry on another replica)."""


class TurnAborted(RuntimeError):
    """The turn was stopped by something other than its caller (EndSession, a cancelled first attempt)."""


@dataclass
class ServerOptions:
    host: str = "127.0.0.1"
    port: int = 50051
    """0 picks a free port (``start`` returns it)."""
    max_message_bytes: int = 4 * 2**20
    """Largest request or response message; larger ones get RESOURCE_EXHAUSTED."""
    limits: Limits = field(default_factory=Limits)
    idempotency_window: int = 32
    """Completed turns remembered per session for request_id replay."""
    resume_wait_s: float = 5.0
    """How long a request waits for the store to catch up with its expected_turn_index."""
    snapshot_kv: bool = True
    """Snapshots carry the KV (resume without recompute); False: only the history."""
    snapshot_queue: int = 4096
    """Bound of the write-behind queue of dirty sessions."""
    snapshot_retry_max_s: float = 5.0
    session_idle_s: float = 3600.0
    """Sessions idle this long, with their snapshot committed, are freed here (they resume from the store)."""
    grace_s: float = 30.0
    """Shutdown: how long running turns may finish."""
    flush_timeout_s: float = 30.0
    """Shutdown: how long pending snapshots may take to write."""
    auth: Authenticator = field(default_factory=Authenticator)
    tenant_limits: TenantLimits = field(default_factory=TenantLimits)
    """Per-tenant quotas: live sessions, tokens per turn (sidecar/limits.py)."""
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_client_ca: str | None = None
    """With a CA file, clients must present a certificate it signed (mutual TLS)."""


class ServerHooks:
    """Callbacks at interesting points; the defaults do nothing (a metrics exporter overrides them)."""

    def on_rpc(self, method: str, code: grpc.StatusCode, seconds: float) -> None:
        pass

    def on_turn(self, completion: pb.TurnCompletion, seconds: float) -> None:
        pass

    def on_snapshot(self, key: str, nbytes: int, seconds: float) -> None:
        pass

    def on_snapshot_failed(self, key: str, reason: str) -> None:
        """A snapshot attempt that did not commit (store down, conflict, refused)."""

    def on_prune(self, pruned_tokens: int, removed: int) -> None:
        """A PruneHistory call pruned ``pruned_tokens`` history tokens (``removed`` KV entries)."""


_CODES: list[tuple[type[BaseException] | tuple, grpc.StatusCode]] = [
    (Unauthenticated, grpc.StatusCode.UNAUTHENTICATED),
    (QuotaExceeded, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (SnapshotRejected, grpc.StatusCode.DATA_LOSS),
    ((InvalidRequest, TurnTooLarge, BadSessionId, ChatError, MethodError, SamplingError, ConfigError, ContextFull,
      OutputSpecError, ConstraintError),
     grpc.StatusCode.INVALID_ARGUMENT),
    (SessionNotFound, grpc.StatusCode.NOT_FOUND),
    (SessionExists, grpc.StatusCode.ALREADY_EXISTS),
    ((SessionBusy, TurnAborted), grpc.StatusCode.ABORTED),
    (CapacityError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (SessionError, grpc.StatusCode.FAILED_PRECONDITION),
    (RequestError, grpc.StatusCode.INVALID_ARGUMENT),
    ((StoreUnavailable, Draining, EngineFailed), grpc.StatusCode.UNAVAILABLE),
]


def status_for(e: BaseException) -> grpc.StatusCode:
    for kinds, code in _CODES:
        if isinstance(e, kinds):
            return code
    return grpc.StatusCode.INTERNAL


class _BadMessage:
    """A request that failed to parse (e.g. invalid UTF-8 in a string field)."""

    def __init__(self, error: str):
        self.error = error


def _parser(cls):
    def parse(data: bytes):
        try:
            return cls.FromString(data)
        except DecodeError as e:
            return _BadMessage(str(e))

    return parse


class SidecarService:
    """The ``chainkv.v1.Sidecar`` servicer."""

    def __init__(self, server: "SidecarServer"):
        self.srv = server
        self.engine = server.engine
        self.loop_ = server.engine_loop
        self.sessions = server.sessions
        self.renderer = server.renderer
        self.opts = server.options
        self.hooks = server.hooks
        self._settling: set[asyncio.Task] = set()

    # --- plumbing ------------------------------------------------------------------------------------
    def handlers(self) -> grpc.GenericRpcHandler:
        def unary(fn, req, resp):
            return grpc.unary_unary_rpc_method_handler(fn, request_deserializer=_parser(req),
                                                       response_serializer=resp.SerializeToString)

        return grpc.method_handlers_generic_handler(SERVICE, {
            "Turn": grpc.unary_stream_rpc_method_handler(self.Turn, request_deserializer=_parser(pb.TurnRequest),
                                                         response_serializer=pb.TurnEvent.SerializeToString),
            "Resume": unary(self.Resume, pb.ResumeRequest, pb.Session),
            "EndSession": unary(self.EndSession, pb.EndSessionRequest, pb.EndSessionResponse),
            "GetSession": unary(self.GetSession, pb.GetSessionRequest, pb.Session),
            "ForkSession": unary(self.ForkSession, pb.ForkSessionRequest, pb.Session),
            "PruneHistory": unary(self.PruneHistory, pb.PruneHistoryRequest, pb.PruneHistoryResponse),
            "GetServerInfo": unary(self.GetServerInfo, pb.GetServerInfoRequest, pb.ServerInfo),
        })

    def _begin(self, request, context) -> str:
        """Common checks; returns the caller's tenant."""
        if isinstance(request, _BadMessage):
            raise InvalidRequest(f"the request could not be parsed: {request.error}")
        tenant = self.opts.auth.tenant(context.invocation_metadata())
        bind_request(tenant, getattr(request, "session_id", ""))
        if self.srv.draining:
            raise Draining("the sidecar is shutting down; retry on another replica")
        if self.loop_.failed is not None:
            raise EngineFailed(f"the engine stopped: {self.loop_.failed!r}")
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
            await context.abort(code, str(e) or type(e).__name__)
        self.hooks.on_rpc(name, grpc.StatusCode.OK, time.monotonic() - t0)
        return reply

    # --- Turn --------------------------------------------------------------------------------------------
    async def Turn(self, request, context):
        t0 = time.monotonic()
        code = grpc.StatusCode.CANCELLED
        try:
            async for event in self._turn(request, context):
                yield event
            code = grpc.StatusCode.OK
        except Exception as e:
            code = status_for(e)
            if code is grpc.StatusCode.INTERNAL:
                log.exception("Turn failed")
            await context.abort(code, str(e) or type(e).__name__)
        finally:
            self.hooks.on_rpc("Turn", code, time.monotonic() - t0)

    async def _turn(self, request, context):
        tenant = self._begin(request, context)
        args = parse_turn(request, self.opts.limits)
        limits = self.opts.tenant_limits
        args.params.max_tokens = limits.check_max_tokens(tenant, args.params.max_tokens,
                                                         request.HasField("max_tokens"))
        key = scoped_key(tenant, args.session_id)
        self._check_quota(tenant, key)
        s = await self.sessions.get(key, create=True, expected_turn_index=args.expected_turn_index,
                                    deadline=self._deadline(context))
        if args.request_id:
            recorded = await self._recorded(s, args.request_id)
            if recorded is not None:
                for event in replay_events(recorded):
                    yield event
                return
        await self._constrain(s, args)
        running = self.sessions.begin_turn(s, args.request_id)
        if not s.in_engine:  # a new session: recheck the quota now that it is taken (no await since)
            try:
                limits.check_new_session(tenant, self.sessions.all(), exclude=key)
            except QuotaExceeded:
                self.sessions.end_turn(s, running, None)
                raise
        state: dict[str, Any] = {"finished": False, "completion": None, "t0": time.monotonic()}
        try:
            async for event in self._run_turn(s, key, args, state):
                yield event
        finally:
            if state["finished"]:
                self.sessions.end_turn(s, running, state["completion"])
            else:
                self._settle_later(s, key, running, state.get("started", False))

    async def _constrain(self, s: Session, args) -> None:
        """Structured output: the turn's grammar, compiled off the engine thread (which then finds it
        cached) and before the session is taken, so a bad schema leaves the session untouched."""
        constraint = args.output.constraint(args.tools or tools_from_meta(s.tools))
        if constraint is not None:
            await asyncio.to_thread(self.engine.grammars.compile, constraint)
            args.params.constraint = constraint

    async def _recorded(self, s: Session, request_id: str) -> bytes | None:
        if request_id in s.records:
            return s.records[request_id]
        if s.running is not None and s.running.request_id == request_id:
            result = await asyncio.shield(s.running.done)
            if result is None:
                raise TurnAborted(f"the first attempt of request {request_id!r} did not finish; retry it")
            return result
        return None

    async def _run_turn(self, s: Session, key: str, args, state: dict):
        eng, new = self.engine, not s.in_engine
        digest = tools_digest(args.tools)
        if not new and args.tools and digest != s.tools_digest:
            raise SessionError("a session's tools are fixed by its first turn; start a new session to change them")
        if new:
            rendered = await asyncio.to_thread(self.renderer.first_turn, args.messages, args.tools,
                                               args.shared_prefix_messages)
        else:
            rendered = await asyncio.to_thread(self.renderer.continuation, args.messages, s.ends_with_eot)
        self.opts.tenant_limits.check_prompt(TenantLimits.tenant_of(key), len(rendered.token_ids))
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()

        def sink(out):  # on the engine thread
            info = None
            if isinstance(out, RequestOutput) and out.finished:
                try:
                    info = eng.session_info(key)
                except SessionNotFound:
                    pass
            loop.call_soon_threadsafe(queue.put_nowait, (out, info))

        def start():  # on the engine thread
            before = len(eng.session_info(key)["prune_log"]) if not new else 0
            eng.add_turn(key, rendered.token_ids, args.params, spans=rendered.spans, method=args.method,
                         expected_turn_index=args.expected_turn_index,
                         shared_prefix=rendered.shared_prefix if new else 0)
            self.loop_.register(key, sink)
            return before

        prunes_before = await self.loop_.call(start)
        state["started"] = True
        if new:
            s.in_engine, s.tools_digest, s.source_tier = True, digest, "new"
            s.tools = [t.openai() for t in args.tools]
        parser, text, calls = (ToolCallParser() if args.output.parses_tools else PlainText()), [], []
        turn_index = s.turn_index
        while True:
            out, info = await queue.get()
            if isinstance(out, BaseException):
                raise EngineFailed(f"the engine failed during the turn: {out!r}")
            events = parser.feed(out.new_text)
            if out.finished:
                events += parser.finish()
            replies = []
            for kind, value in events:
                if kind == "text":
                    text.append(value)
                    replies.append(pb.TurnEvent(delta=pb.TextDelta(text=value)))
                else:
                    call = tool_call_proto(turn_index, len(calls), value.name, value.arguments_json)
                    calls.append(call)
                    replies.append(pb.TurnEvent(tool_call=call))
            if out.new_token_ids:
                if replies and replies[0].HasField("delta"):
                    replies[0].delta.token_ids.extend(out.new_token_ids)
                else:
                    replies.insert(0, pb.TurnEvent(delta=pb.TextDelta(token_ids=out.new_token_ids)))
            for r in replies:
                yield r
            if out.finished:
                break
        if out.finish_reason == "abort":
            raise TurnAborted("the turn was stopped (the session was ended)")
        if out.finish_reason == "error":
            raise CapacityError(out.error or "the KV pool could not hold the turn")
        new_prunes = info["prune_log"][prunes_before:] if info else []
        usage = pb.Usage(prompt_tokens=len(rendered.token_ids), reused_tokens=out.counters.reused_tokens,
                         prefilled_tokens=out.counters.prefilled_tokens,
                         pruned_tokens=sum(e["end"] - e["start"] for e in new_prunes),
                         generated_tokens=len(out.token_ids), time_to_first_token_s=out.time_to_first_token or 0.0,
                         source_tier=TIERS.get(out.source_tier or "", pb.TIER_UNSPECIFIED),
                         history_tokens=info["num_tokens"] if info else 0, kv_tokens=info["kv_tokens"] if info else 0)
        reason = FINISH.get(out.finish_reason, pb.FINISH_REASON_STOP)
        if calls and reason == pb.FINISH_REASON_STOP:
            reason = pb.FINISH_REASON_TOOL_CALLS
        completion = pb.TurnCompletion(
            session_id=args.session_id, request_id=args.request_id, turn_index=turn_index,
            generation=info["generation"] if info else 0, finish_reason=reason, text="".join(text), tool_calls=calls,
            token_ids=list(out.token_ids), usage=usage)
        if info:
            s.update(info, self.sessions.end_of_turn_id)
        state["finished"], state["completion"] = True, completion.SerializeToString()
        self.srv.mark_dirty(key)
        self.hooks.on_turn(completion, time.monotonic() - state["t0"])
        yield pb.TurnEvent(completion=completion)

    def _settle_later(self, s: Session, key: str, running, started: bool) -> None:
        """The caller went away (cancel, deadline) or the turn failed: abort it on the engine thread,
        then release the session. Runs as its own task: the handler's task is being cancelled."""
        eng = self.engine

        def abort():  # on the engine thread
            self.loop_.unregister(key)
            if started:
                eng.abort(key)  # rolls the turn back (None if it had already finished)
            try:
                info = eng.session_info(key)
            except SessionNotFound:
                return None
            if info["turn_index"] == 0 and info["num_tokens"] == 0:  # a new session's first turn: nothing left
                eng.end_session(key)
                return None
            return info

        async def settle():
            try:
                info = await self.loop_.call(abort)
            except Exception:
                log.exception("aborting the turn on %s failed", key)
                info = None
            if info is None:
                s.in_engine = False
            else:
                changed = info["generation"] != s.generation
                s.update(info, self.sessions.end_of_turn_id)
                if changed:
                    self.srv.mark_dirty(key)
            self.sessions.end_turn(s, running, None)

        task = asyncio.ensure_future(settle())
        self._settling.add(task)
        task.add_done_callback(self._settling.discard)

    def _check_quota(self, tenant: str, key: str) -> None:
        """A request that would hold one more session of ``tenant`` here: within its quota?"""
        s = self.sessions.local(key)
        if s is None or not (s.in_engine or s.busy):
            self.opts.tenant_limits.check_new_session(tenant, self.sessions.all(), exclude=key)

    async def settle_all(self) -> None:
        while self._settling:
            await asyncio.gather(*list(self._settling), return_exceptions=True)

    # --- sessions ------------------------------------------------------------------------------------------
    async def Resume(self, request, context):
        return await self._unary("Resume", self._resume, request, context)

    async def _resume(self, request, context):
        tenant = self._begin(request, context)
        key = scoped_key(tenant, request.session_id)
        expected = request.expected_turn_index if request.HasField("expected_turn_index") else None
        self._check_quota(tenant, key)
        s = await self.sessions.get(key, create=False, expected_turn_index=expected, deadline=self._deadline(context))
        if not s.in_engine:
            raise SessionNotFound(f"no session {request.session_id!r}")
        info = await self.loop_.call(self.engine.session_info, key)
        return session_proto(request.session_id, info, s, _tier(s, info), self.srv.store is not None)

    async def GetSession(self, request, context):
        return await self._unary("GetSession", self._get_session, request, context)

    async def _get_session(self, request, context):
        tenant = self._begin(request, context)
        key = scoped_key(tenant, request.session_id)
        s = self.sessions.local(key)
        if s is not None and s.in_engine:
            info = await self.loop_.call(self.engine.session_info, key)
            if s.busy:
                info["state"] = "active"
            return session_proto(request.session_id, info, s, _tier(s, info), self.srv.store is not None)
        if self.srv.store is not None:
            stored = await asyncio.to_thread(self.srv.store.load, key, False)
            if stored is not None:
                return stored_session_proto(request.session_id, stored.record)
        raise SessionNotFound(f"no session {request.session_id!r}")

    async def EndSession(self, request, context):
        return await self._unary("EndSession", self._end_session, request, context)

    async def _end_session(self, request, context):
        tenant = self._begin(request, context)
        key = scoped_key(tenant, request.session_id)
        here, deleted = await self.sessions.end(key, request.keep_snapshot, self.srv.write_now)
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
        parent = await self.sessions.get(key, create=False)
        if not parent.in_engine:
            raise SessionNotFound(f"no session {request.session_id!r}")
        existing = self.sessions.local(child_key)
        if existing is not None and (existing.in_engine or existing.busy):
            raise SessionExists(f"session {request.new_session_id!r} already exists")
        if self.srv.store is not None and await asyncio.to_thread(self.srv.store.load, child_key, False) is not None:
            raise SessionExists(f"session {request.new_session_id!r} already exists (in the store)")
        self.opts.tenant_limits.check_new_session(tenant, self.sessions.all(), exclude=child_key)
        running = self.sessions.begin_turn(parent, "")
        try:
            def fork():
                self.engine.fork_session(key, child_key)
                return self.engine.session_info(child_key)

            info = await self.loop_.call(fork)
        finally:
            self.sessions.end_turn(parent, running, None)
        child = self.sessions.adopt(child_key, tools_digest=parent.tools_digest, info=info, tools=parent.tools)
        self.srv.mark_dirty(child_key)
        return session_proto(request.new_session_id, info, child, has_store=self.srv.store is not None)

    async def PruneHistory(self, request, context):
        return await self._unary("PruneHistory", self._prune, request, context)

    async def _prune(self, request, context):
        tenant = self._begin(request, context)
        key = scoped_key(tenant, request.session_id)
        if request.prune_policy not in ("", "drop", "keep_ratio"):
            raise InvalidRequest(f"prune_policy must be drop or keep_ratio, not {request.prune_policy!r}")
        if request.prune_scope not in ("", "global", "per_head"):
            raise InvalidRequest(f"prune_scope must be global or per_head, not {request.prune_scope!r}")
        keep = request.prune_keep_ratio if request.HasField("prune_keep_ratio") else None
        if keep is not None and not 0 <= keep <= 1:
            raise InvalidRequest(f"prune_keep_ratio must be in [0, 1], not {keep}")
        if request.end and request.start >= request.end:
            raise InvalidRequest("a span to prune needs start < end")
        s = await self.sessions.get(key, create=False)
        if not s.in_engine:
            raise SessionNotFound(f"no session {request.session_id!r}")
        eng = self.engine
        cfg = eng.config
        policy = dict(policy=request.prune_policy or None, keep_ratio=keep, scope=request.prune_scope or None)

        def prune():
            info = eng.session_info(key)
            if request.end:
                if request.end > info["num_tokens"]:
                    raise InvalidRequest(f"span ({request.start}, {request.end}) lies outside the "
                                         f"{info['num_tokens']}-token history")
                spans = [(request.start, request.end)]
            else:
                roles = list(request.prune_roles) or list(cfg.prune_roles)
                lag = request.prune_lag if request.HasField("prune_lag") else (cfg.prune_lag or 0)
                spans = [(sp["start"], sp["end"]) for sp in info["spans"]
                         if not sp["pruned"] and sp["role"] in roles and info["turn_index"] - sp["turn"] >= lag]
            removed = sum(eng.prune_history(key, a, b, **policy) for a, b in spans)
            return removed, sum(b - a for a, b in spans), eng.session_info(key)

        running = self.sessions.begin_turn(s, "")
        try:
            removed, tokens, info = await self.loop_.call(prune)
        finally:
            self.sessions.end_turn(s, running, None)
        if tokens:
            s.update(info, self.sessions.end_of_turn_id)
            self.srv.mark_dirty(key)
            self.hooks.on_prune(tokens, removed)
        return pb.PruneHistoryResponse(removed=removed, pruned_tokens=tokens,
                                       session=session_proto(request.session_id, info, s, has_store=self.srv.store is not None))

    async def GetServerInfo(self, request, context):
        return await self._unary("GetServerInfo", self._server_info, request, context)

    async def _server_info(self, request, context):
        self._begin(request, context)
        eng, mc = self.engine, self.engine.model_config
        return pb.ServerInfo(model=eng.model_dir.name, architecture=mc.architecture, max_model_len=eng.max_model_len,
                             default_max_tokens=self.opts.limits.default_max_tokens, method=eng.config.method,
                             methods=sorted(METHODS), vocab_size=mc.vocab_size)


def _tier(s: Session, info: dict) -> str | None:
    """Where the session's next turn would find it (a loaded snapshot counts as the store)."""
    if info["state"] == "host" and s.source_tier in ("store", "recompute"):
        return s.source_tier
    return None  # session_proto derives it from the state


def replay_events(completion_bytes: bytes) -> list[pb.TurnEvent]:
    """A recorded turn as a stream: its text, its tool calls, its completion marked replayed."""
    c = pb.TurnCompletion.FromString(completion_bytes)
    c.replayed = True
    events = [pb.TurnEvent(delta=pb.TextDelta(text=c.text, token_ids=c.token_ids))]
    events += [pb.TurnEvent(tool_call=call) for call in c.tool_calls]
    events.append(pb.TurnEvent(completion=c))
    return events


class SidecarServer:
    """The sidecar: gRPC server, engine thread, sessions, snapshot writer, health and reflection."""

    def __init__(self, engine: LLMEngine, options: ServerOptions | None = None, store: SessionStore | None = None,
                 hooks: ServerHooks | None = None):
        self.engine = engine
        self.options = options or ServerOptions()
        self.store = store
        self.hooks = hooks or ServerHooks()
        # its own tokenizer: rendering runs on worker threads while the engine thread detokenizes
        self.renderer = ChatRenderer(load_tokenizer(engine.model_dir) or engine.tokenizer, engine.eos_token_ids)
        self.draining = False
        self.port: int | None = None
        self._stopped: asyncio.Event | None = None
        self.engine_loop: EngineLoop | None = None
        self.sessions: SessionManager | None = None
        self.writer: SnapshotWriter | None = None
        self.health = health.aio.HealthServicer()
        self._server: grpc.aio.Server | None = None
        self._janitor: asyncio.Task | None = None

    # --- lifecycle ---------------------------------------------------------------------------------------
    async def start(self) -> int:
        o = self.options
        self._stopped = asyncio.Event()
        self.engine_loop = EngineLoop(self.engine, on_failure=self._engine_failed)
        self.engine_loop.start(asyncio.get_running_loop())
        self.sessions = SessionManager(self.engine_loop, self.store, end_of_turn_id=self.renderer.end_of_turn_id,
                                       idempotency_window=o.idempotency_window, resume_wait_s=o.resume_wait_s)
        if self.store is not None:
            self.writer = SnapshotWriter(self.store, self.engine_loop, self.sessions, with_kv=o.snapshot_kv,
                                         max_pending=o.snapshot_queue, retry_max_s=o.snapshot_retry_max_s,
                                         hooks=self.hooks)
            self.writer.start()
        self.service = SidecarService(self)
        self._server = grpc.aio.server(options=[
            ("grpc.max_receive_message_length", o.max_message_bytes),
            ("grpc.max_send_message_length", o.max_message_bytes),
            ("grpc.so_reuseport", 0),
        ])
        self._server.add_generic_rpc_handlers((self.service.handlers(),))
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self._server)
        reflection.enable_server_reflection(
            [SERVICE, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME], self._server)
        address = f"{o.host}:{o.port}"
        if o.tls_cert or o.tls_key:
            if not (o.tls_cert and o.tls_key):
                raise ConfigError("TLS needs both a certificate and a key")
            ca = Path(o.tls_client_ca).read_bytes() if o.tls_client_ca else None
            creds = grpc.ssl_server_credentials([(Path(o.tls_key).read_bytes(), Path(o.tls_cert).read_bytes())],
                                                root_certificates=ca, require_client_auth=ca is not None)
            self.port = self._server.add_secure_port(address, creds)
        else:
            self.port = self._server.add_insecure_port(address)
        if not self.port:
            raise ConfigError(f"cannot listen on {address}")
        await self._server.start()
        await self._set_health(health_pb2.HealthCheckResponse.SERVING)
        self._janitor = asyncio.create_task(self._janitor_loop(), name="chainkv-janitor")
        log.info("chainkv sidecar serving on %s:%d (store: %s)", o.host, self.port,
                 self.store.describe() if self.store else "none")
        return self.port

    async def _set_health(self, status) -> None:
        for name in ("", SERVICE):
            await self.health.set(name, status)

    def _engine_failed(self, error: BaseException) -> None:
        asyncio.ensure_future(self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING))

    async def stop(self, grace: float | None = None) -> None:
        """Graceful shutdown: NOT_SERVING, refuse new turns, let running ones finish (``grace``),
        write pending snapshots, stop."""
        if self._server is None:
            return
        grace = self.options.grace_s if grace is None else grace
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        self.draining = True
        until = time.monotonic() + grace
        while self.sessions.active_turns and time.monotonic() < until:
            await asyncio.sleep(0.05)
        await self._server.stop(max(0.0, until - time.monotonic()))
        await self.service.settle_all()
        if self.writer is not None:
            if not await self.writer.flush(self.options.flush_timeout_s):
                log.warning("shutdown: %d session snapshot(s) not written", sum(s.snapshot_pending for s in self.sessions.all()))
            await self.writer.stop()
        if self._janitor is not None:
            self._janitor.cancel()
        await asyncio.to_thread(self.engine_loop.stop)
        if self.store is not None:
            self.store.close()
        self._server = None
        self._stopped.set()

    async def wait(self) -> None:
        await self._stopped.wait()

    # --- helpers for the servicer ------------------------------------------------------------------------
    def mark_dirty(self, key: str) -> None:
        if self.writer is not None:
            self.writer.mark_dirty(key)

    async def write_now(self, key: str) -> None:
        if self.writer is not None:
            await self.writer.write(key)

    async def _janitor_loop(self) -> None:
        while True:
            await asyncio.sleep(min(60.0, max(1.0, self.options.session_idle_s / 4)))
            try:
                n = await self.sessions.evict_idle(self.options.session_idle_s)
                if n:
                    log.info("freed %d idle session(s) (their snapshots are committed)", n)
                sweep = getattr(self.store, "sweep", None)
                if sweep is not None:
                    await asyncio.to_thread(sweep)
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("janitor pass failed")


class ServerThread:
    """A SidecarServer on its own event loop in a background thread (embedding, tests)."""

    def __init__(self, engine: LLMEngine, options: ServerOptions | None = None, store: SessionStore | None = None,
                 hooks: ServerHooks | None = None):
        self.server = SidecarServer(engine, options, store, hooks)
        self.loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="chainkv-server", daemon=True)

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)

        async def main():
            try:
                await self.server.start()
            except BaseException as e:
                self._error = e
                self._ready.set()
                return
            self._ready.set()
            await self.server.wait()

        self.loop.run_until_complete(main())

    def start(self) -> int:
        self._thread.start()
        self._ready.wait()
        if self._error is not None:
            raise self._error
        return self.server.port

    def run(self, coro, timeout: float | None = 60.0) -> Any:
        """Run a coroutine on the server's loop (to inspect or change its state) and return its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def call(self, fn: Callable[[], Any], timeout: float | None = 60.0) -> Any:
        async def wrap():
            return fn()

        return self.run(wrap(), timeout)

    def stop(self, grace: float | None = 5.0) -> None:
        if self._thread.is_alive():
            self.run(self.server.stop(grace), timeout=None)
            self._thread.join(30)
