"""TurnRunner: one Turn RPC from request to completion, and what happens when it does not finish.

A Turn's life: validate -> find or load the session (after any abandoned turn on it is rolled
back) -> replay if its request_id is recorded -> take the session -> render the new messages ->
start the turn on the engine (``EngineClient.start_turn``) -> stream deltas and tool calls as the
engine's outputs arrive -> record the completion -> mark the session dirty for the snapshot
writer -> release the session.

A turn that does not finish is rolled back on the engine (``EngineClient.release_turn``: abort,
then the chain undoes the turn) before the session is released:

- it failed (a bad message, a prompt over quota, a full KV pool, EndSession stopping it): the
  release is awaited *before* the error propagates, so by the time the client sees the status the
  session is free and its next Turn is not refused as busy;
- its caller went away (cancel, deadline, or the stream closed: every caller closes the events'
  generator, ``contextlib.aclosing``, so this happens at once and not when the generator is
  garbage-collected): the handler is being cancelled and cannot wait, so the release runs as its
  own task and the session is marked settling.

Either way a request that arrives for the session while the turn runs waits for it to end
(``SessionManager.get_settled``): the client's cancel may reach the server after its next request.

``TurnState`` carries the turn through this: the session taken, the request, and the recorded
completion once there is one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import asdict, dataclass, field
from typing import AsyncIterator, Callable

from engine.api import CapacityError, ConstraintError, SessionError, SessionInfo, TurnSpec
from sidecar._proto.chainkv.v1 import sidecar_pb2 as pb
from sidecar.engine_bridge.client import EngineClient
from sidecar.engine_bridge.results import TurnResult
from sidecar.session_ids import SessionKey
from sidecar.sessions.manager import SessionManager
from sidecar.sessions.record import Running, Session
from sidecar.turns.chat import ChatRenderer, tools_digest
from sidecar.turns.errors import SequenceFailed, TurnAborted
from sidecar.turns.hooks import ServerHooks
from sidecar.turns.limits import QuotaExceeded, TenantLimits
from sidecar.turns.protocol import FINISH, TIERS, Limits, TurnArgs, parse_turn, tool_call_proto
from sidecar.turns.request import TurnRequest
from sidecar.turns.structured import OutputSpecError, tools_from_meta
from sidecar.turns.tool_calls import PlainText, ToolCallParser
from sidecar.turns.validation import check_same_request

log = logging.getLogger(__name__)


@dataclass
class TurnState:
    """A turn that holds its session."""

    session: Session
    key: str
    args: TurnArgs
    running: Running
    started_at: float = field(default_factory=time.monotonic)
    completion: bytes | None = None
    """The serialized TurnCompletion once the turn finished (what a retry replays)."""
    on_complete: Callable[[Session, pb.TurnCompletion], None] | None = None
    """The caller's, called when the turn finished, before its snapshot is taken (a front's metadata
    about the turn, ``Session.front``, then travels with that snapshot)."""

    @property
    def finished(self) -> bool:
        return self.completion is not None


class TurnRunner:
    """Runs Turn requests against the engine client and the session manager."""

    def __init__(
        self,
        client: EngineClient,
        sessions: SessionManager,
        renderer: ChatRenderer,
        *,
        limits: Limits,
        tenant_limits: TenantLimits,
        hooks: ServerHooks,
        sync_commit: bool = False,
    ):
        self.client = client
        self.sessions = sessions
        self.renderer = renderer
        self.limits = limits
        self.tenant_limits = tenant_limits
        self.hooks = hooks
        self.sync_commit = sync_commit
        """durability sync: the turn's snapshot is written (``SessionManager.commit_turn``) before its
        completion is sent."""
        self.settling: set[asyncio.Task] = set()
        """Releases of turns whose callers went away, still running."""

    async def run(
        self,
        tenant: str,
        request: TurnRequest,
        deadline: float | None,
        on_complete: Callable[[Session, pb.TurnCompletion], None] | None = None,
    ) -> AsyncIterator[pb.TurnEvent]:
        """The events of one turn for ``tenant`` (from either front: gRPC's Turn, the HTTP APIs);
        raises what ``status_for`` turns into a code. ``on_complete``: see ``TurnState.on_complete``."""
        args = parse_turn(request, self.limits)
        turn = self.run_args(
            tenant,
            args,
            deadline,
            max_tokens_given=request.max_tokens is not None,
            digest=request.digest,
            on_complete=on_complete,
        )
        async with contextlib.aclosing(turn):  # closed with this one: its turn is released at once
            async for event in turn:
                yield event

    async def run_args(
        self,
        tenant: str,
        args: TurnArgs,
        deadline: float | None,
        *,
        max_tokens_given: bool,
        digest: str = "",
        on_complete: Callable[[Session, pb.TurnCompletion], None] | None = None,
    ) -> AsyncIterator[pb.TurnEvent]:
        """One turn from already-checked arguments (any front: gRPC, HTTP): text and token deltas,
        tool calls, then the completion, as ``chainkv.v1.TurnEvent`` messages. ``digest``: the
        request's content digest (a request_id reused for other content is refused)."""
        args.params.max_tokens = self.tenant_limits.check_max_tokens(tenant, args.params.max_tokens, max_tokens_given)
        key = str(SessionKey.of(tenant, args.session_id))
        self.check_quota(tenant, key)
        if args.hints is not None and args.hints.pin_ttl_s is not None:
            self.tenant_limits.check_pin(tenant, self.sessions.all(), exclude=key, now=time.monotonic())
        s = await self.sessions.get_settled(
            key,
            create=True,
            expected_turn_index=args.expected_turn_index,
            deadline=deadline,
            request_id=args.request_id,
        )
        if args.request_id:
            check_same_request(s, args.request_id, digest)
            recorded = await self._recorded(s, args.request_id)
            if recorded is not None:
                for event in replay_events(recorded):
                    yield event
                return
        await self._constrain(s, args)
        running = self.sessions.begin_turn(s, args.request_id, digest)
        if not s.in_engine:  # a new session: recheck the quota now that it is taken (no await since)
            try:
                self.tenant_limits.check_new_session(tenant, self.sessions.all(), exclude=key)
            except QuotaExceeded:
                self.sessions.end_turn(s, running, None)
                raise
        state = TurnState(session=s, key=key, args=args, running=running, on_complete=on_complete)
        try:
            async with contextlib.aclosing(self._generate(state)) as events:
                async for event in events:
                    yield event
        except Exception:
            if not state.finished:  # release before the error reaches the client
                await asyncio.shield(self._release_later(state))
            raise
        except BaseException:  # cancelled, or the stream closed: nothing may wait here
            if not state.finished:
                self._release_later(state)
            raise
        finally:
            if state.finished:
                self.sessions.end_turn(s, running, state.completion)

    def check_quota(self, tenant: str, key: str) -> None:
        """A request that would hold one more session of ``tenant`` here: within its quota?"""
        s = self.sessions.local(key)
        if s is None or not (s.in_engine or s.busy):
            self.tenant_limits.check_new_session(tenant, self.sessions.all(), exclude=key)

    async def settle_all(self) -> None:
        """Wait for every pending release (shutdown)."""
        while self.settling:
            await asyncio.gather(*list(self.settling), return_exceptions=True)

    # --- internals ---------------------------------------------------------------------------------------
    async def _constrain(self, s: Session, args: TurnArgs) -> None:
        """Structured output: the turn's grammar, compiled off the engine thread (which then finds it
        cached) and before the session is taken, so a bad schema leaves the session untouched."""
        constraint = args.output.constraint(args.tools or tools_from_meta(s.tools))
        if constraint is not None:
            try:
                await asyncio.to_thread(self.client.compile_grammar, constraint)
            except ConstraintError as e:  # the schema, regex or grammar the request gave
                raise OutputSpecError(str(e), args.output.constraint_field) from None
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

    async def _generate(self, state: TurnState) -> AsyncIterator[pb.TurnEvent]:
        s, key, args = state.session, state.key, state.args
        new = not s.in_engine
        digest = tools_digest(args.tools)
        if not new and args.tools and digest != s.tools_digest:
            raise SessionError("a session's tools are fixed by its first turn; start a new session to change them")
        if new:
            rendered = await asyncio.to_thread(
                self.renderer.first_turn, args.messages, args.tools, args.shared_prefix_messages
            )
        else:
            rendered = await asyncio.to_thread(self.renderer.continuation, args.messages, s.ends_with_eot)
        self.tenant_limits.check_prompt(SessionKey.tenant_of(key), len(rendered.token_ids))
        stream = await self.client.start_turn(
            key,
            TurnSpec(
                tokens=rendered.token_ids,
                params=args.params,
                spans=rendered.spans,
                method=args.method,
                expected_turn_index=args.expected_turn_index,
                shared_prefix=rendered.shared_prefix if new else 0,
                prefix_scope="" if args.public_prefix else f"tenant:{SessionKey.tenant_of(key)}",
                hints=args.hints,
            ),
            new_session=new,
        )
        if new:
            s.in_engine, s.tools_digest, s.source_tier = True, digest, "new"
            s.tools = [t.openai() for t in args.tools]
        declared = [t.name for t in args.tools or tools_from_meta(s.tools)]  # a call to any other name is text
        parser, text, calls = (ToolCallParser(declared) if args.output.parses_tools else PlainText()), [], []
        turn_index = s.turn_index
        async for delta in stream:
            events = parser.feed(delta.text)
            if delta.last:
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
            if delta.token_ids:
                if replies and replies[0].HasField("delta"):
                    replies[0].delta.token_ids.extend(delta.token_ids)
                else:
                    replies.insert(0, pb.TurnEvent(delta=pb.TextDelta(token_ids=delta.token_ids)))
            for r in replies:
                yield r
        result = stream.result
        if result.finish_reason == "abort":
            raise TurnAborted("the turn was stopped (the session was ended)")
        if result.finish_reason == "error":
            raise CapacityError(result.error or "the KV pool could not hold the turn")
        if result.finish_reason == "failed":
            raise SequenceFailed(f"the turn failed and was rolled back: {result.error}")
        completion = completion_proto(args, turn_index, result, "".join(text), calls)
        if args.hints is not None and (args.hints.release or args.hints.pin_ttl_s is not None):
            s.pinned_until = 0.0 if args.hints.release else time.monotonic() + args.hints.pin_ttl_s
        if result.session is not None:
            s.update(result.session, self.sessions.end_of_turn_id)
        state.completion = completion.SerializeToString()
        if state.on_complete is not None:
            state.on_complete(s, completion)
        if self.sync_commit:
            await self.sessions.commit_turn(s, state.running, state.completion)
        self.sessions.mark_dirty(key)
        self.hooks.on_turn(completion, time.monotonic() - state.started_at)
        yield pb.TurnEvent(completion=completion)

    def _release_later(self, state: TurnState) -> asyncio.Task:
        """Roll the unfinished turn back on the engine, then release its session, as a task of its own
        (it outlives a cancelled handler); the session is settling until then."""
        state.running.settling = True
        task = asyncio.ensure_future(self._release(state))
        self.settling.add(task)
        task.add_done_callback(self.settling.discard)
        return task

    async def _release(self, state: TurnState) -> None:
        s, key = state.session, state.key
        info: SessionInfo | None
        try:
            info = await self.client.release_turn(key)
        except Exception:
            log.exception("aborting the turn on %s failed", key)
            info = None
        if info is None:
            s.in_engine = False
        else:
            changed = info.generation != s.generation
            s.update(info, self.sessions.end_of_turn_id)
            if changed:
                self.sessions.mark_dirty(key)
        self.sessions.end_turn(s, state.running, None)


def completion_proto(
    args: TurnArgs, turn_index: int, result: TurnResult, text: str, calls: list[pb.ToolCall]
) -> pb.TurnCompletion:
    """The Turn's last event: what was generated, why it stopped, and what it cost."""
    info = result.session
    usage = pb.Usage(
        prompt_tokens=result.prompt_tokens,
        reused_tokens=result.reused_tokens,
        prefilled_tokens=result.prefilled_tokens,
        pruned_tokens=result.pruned_tokens,
        generated_tokens=len(result.token_ids),
        time_to_first_token_s=result.time_to_first_token or 0.0,
        source_tier=TIERS.get(result.source_tier or "", pb.TIER_UNSPECIFIED),
        history_tokens=info.num_tokens if info else 0,
        kv_tokens=info.kv_tokens if info else 0,
        recall=pb.RecallTraffic(**asdict(info.recall)) if info else None,
    )
    if result.timing is not None:
        t = result.timing
        usage.timing.CopyFrom(pb.TurnTiming(**t.breakdown(), total_s=t.total_s, recompute_tokens=t.recompute_tokens))
    reason = FINISH.get(result.finish_reason, pb.FINISH_REASON_STOP)
    if calls and reason == pb.FINISH_REASON_STOP:
        reason = pb.FINISH_REASON_TOOL_CALLS
    return pb.TurnCompletion(
        session_id=args.session_id,
        request_id=args.request_id,
        turn_index=turn_index,
        generation=info.generation if info else 0,
        finish_reason=reason,
        text=text,
        tool_calls=calls,
        token_ids=list(result.token_ids),
        usage=usage,
    )


def replay_events(completion_bytes: bytes) -> list[pb.TurnEvent]:
    """A recorded turn as a stream: its text, its tool calls, its completion marked replayed."""
    c = pb.TurnCompletion.FromString(completion_bytes)
    c.replayed = True
    events = [pb.TurnEvent(delta=pb.TextDelta(text=c.text, token_ids=c.token_ids))]
    events += [pb.TurnEvent(tool_call=call) for call in c.tool_calls]
    events.append(pb.TurnEvent(completion=c))
    return events
