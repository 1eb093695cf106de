"""EngineClient: the one door from asyncio to the engine thread.

The engine is not thread-safe: one thread (``EngineLoop``) owns it, runs commands between forward
passes and steps it. Everything on the asyncio side (the gRPC servicer, the session manager, the
snapshot writer, an HTTP front) reaches the engine only through this client's typed async methods.
Each runs its engine work as a method of the client on the engine thread; what crosses back is
frozen: the engine's own typed reports (``SessionInfo``, ``EngineStats``: engine/api.py) and the
values of ``sidecar.engine_bridge.results`` the client copies live ``RequestOutput`` objects into, so
nothing on the event loop reads engine state the engine thread may be changing.

    client = EngineClient(engine)
    client.start()                                    # on the event loop
    stream = await client.start_turn(key, TurnSpec(token_ids, params), new_session=True)
    async for delta in stream:                        # TurnDelta per engine step
        ...
    stream.result                                     # TurnResult: finish reason, usage, SessionInfo
    await client.release_turn(key)                    # a turn that will not be finished: roll it back

Tokenizer. The chat renderer encodes on worker threads while the engine thread decodes with the
same tokenizer (``client.tokenizer``). A fast tokenizer's encode and decode only read it; the one
call that writes it (setting truncation or padding) runs only when a call asks for settings other
than the current ones, which rendering never does after its first, start-up encode.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
from dataclasses import dataclass
from typing import Any, Callable, Hashable

from engine.api import (
    EngineStats,
    LLMEngine,
    RequestOutput,
    SessionInfo,
    SessionNotFound,
    SessionSnapshot,
    TurnSpec,
    check_policy,
    check_span,
    due_spans,
)
from sidecar.engine_bridge.loop import EngineFailed, EngineLoop
from sidecar.engine_bridge.results import PruneResult, TurnDelta, TurnResult

log = logging.getLogger(__name__)

__all__ = ["EngineClient", "EngineFailed", "PruneSpec", "TurnStream"]


@dataclass(frozen=True)
class PruneSpec:
    """What PruneHistory prunes: one span of the history, or the spans the rule selects
    (``roles`` written ``lag`` or more turns ago), with a policy (None: the engine's default)."""

    span: tuple[int, int] | None = None
    roles: tuple[str, ...] = ()
    """Empty: the engine's ``prune_roles``."""
    lag: int | None = None
    """None: the engine's ``prune_lag`` (0 when it has none)."""
    policy: str | None = None
    keep_ratio: float | None = None
    scope: str | None = None


class TurnStream:
    """A running turn's outputs: ``async for`` gives a ``TurnDelta`` per engine step; after the
    last one, ``result`` holds the ``TurnResult``. Raises ``EngineFailed`` if the engine stops."""

    def __init__(self, key: str, prompt_tokens: int, loop: asyncio.AbstractEventLoop):
        self.key = key
        self.prompt_tokens = prompt_tokens
        self.result: TurnResult | None = None
        self._queue: asyncio.Queue = asyncio.Queue()
        self._loop = loop
        self.prunes_before = 0
        """The session's prune log length before the turn (its new entries are the turn's)."""

    def push(self, item: tuple[TurnDelta, TurnResult | None] | BaseException) -> None:
        """Called on the engine thread: hand ``item`` to the event loop (never blocks the engine)."""
        self._loop.call_soon_threadsafe(self._queue.put_nowait, item)

    def __aiter__(self):
        return self._deltas()

    async def _deltas(self):
        while self.result is None:
            item = await self._queue.get()
            if isinstance(item, BaseException):
                raise EngineFailed(f"the engine failed during the turn: {item!r}")
            delta, result = item
            if result is not None:
                self.result = result
            yield delta


class EngineClient:
    """Typed async access to an ``LLMEngine`` running on its own thread (see the module docstring)."""

    def __init__(self, engine: LLMEngine, on_failure: Callable[[BaseException], None] | None = None):
        self._engine = engine
        self._thread = EngineLoop(engine, on_failure=on_failure)
        self.model = engine.model_info()
        self.tokenizer: Any = engine.tokenizer
        """The engine's tokenizer (see the module docstring on sharing it)."""
        self.eos_token_ids: frozenset[int] = frozenset(engine.eos_token_ids)

    # --- lifecycle ------------------------------------------------------------------------------------
    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        self._thread.start(loop or asyncio.get_running_loop())

    async def stop(self) -> None:
        await asyncio.to_thread(self._thread.stop)

    @property
    def failed(self) -> BaseException | None:
        """The error that stopped the engine thread, if one did."""
        return self._thread.failed

    @property
    def steps(self) -> int:
        return self._thread.steps

    def check_serving(self) -> None:
        if self._thread.failed is not None:
            raise EngineFailed(f"the engine stopped: {self._thread.failed!r}")

    def compile_grammar(self, constraint) -> None:
        """Compile a structured-output constraint (thread-safe and cached; call it from a worker
        thread before the turn, so the engine thread finds it compiled)."""
        self._engine.grammars.compile(constraint)

    # --- turns ----------------------------------------------------------------------------------------
    async def start_turn(self, key: str, turn: TurnSpec, new_session: bool = False) -> TurnStream:
        """Queue ``turn`` on session ``key``; its outputs stream. ``new_session``: the turn creates
        the session (else the engine must hold it)."""
        stream = TurnStream(key, len(turn.tokens), asyncio.get_running_loop())
        await self._thread.call(self._start_turn, key, turn, new_session, stream)
        return stream

    async def release_turn(self, key: str) -> SessionInfo | None:
        """Stop streaming ``key``'s turn and abort it if it still runs (the chain rolls it back).
        Returns the session as it stands, or None when nothing is left of it (a new session
        whose first turn did not finish is ended)."""
        return await self._thread.call(self._release_turn, key)

    def abort_soon(self, key: str) -> None:
        """Abort ``key``'s running turn without waiting (safe from a cancelled task)."""
        self._thread.post(self._engine.abort, key)

    # --- sessions -------------------------------------------------------------------------------------
    async def session_info(self, key: str) -> SessionInfo:
        return await self._thread.call(self._info, key)

    async def end_session(self, key: str) -> bool:
        """End ``key`` in the engine; False when the engine does not hold it."""
        return await self._thread.call(self._end_session, key)

    async def fork(self, key: str, child_key: str) -> SessionInfo:
        """A new session ``child_key`` sharing ``key``'s history and KV (copy on write)."""
        return await self._thread.call(self._fork, key, child_key)

    async def set_eviction_priority(self, key: str, priority: int) -> None:
        """Idle sessions of a lower priority are demoted (GPU -> host RAM -> history) first."""
        await self._thread.call(self._engine.set_eviction_priority, key, priority)

    async def span_kv_tokens(self, key: str) -> tuple[float, ...] | None:
        """Per span of ``session_info(key).spans``, the KV entries the GPU holds for it (mean over
        layers and kv-heads); None when the session's KV is not on the GPU."""
        return await self._thread.call(self._span_kv_tokens, key)

    async def prune(self, key: str, spec: PruneSpec) -> PruneResult:
        return await self._thread.call(self._prune, key, spec)

    async def snapshot(self, key: str, with_kv: bool = True) -> SessionSnapshot:
        """The session for a store (history, metadata and, with ``with_kv``, its KV); between turns."""
        return await self._thread.call(self._engine.snapshot_session, key, with_kv)

    async def load(self, snapshot: SessionSnapshot) -> SessionInfo:
        """Put a stored session into the engine (its KV, or its history to re-prefill)."""
        return await self._thread.call(self._load, snapshot)

    def stats_blocking(self, timeout: float = 5.0) -> EngineStats | None:
        """The engine's counters, for a thread other than the event loop's (a metrics scrape): read
        on the engine thread between two steps. None when the engine thread is not running or does
        not answer within ``timeout``."""
        if not self._thread.running:
            return None
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._thread.post(self._stats_into, fut)
        try:
            return fut.result(timeout)
        except concurrent.futures.TimeoutError:
            return None
        except Exception:
            log.exception("reading the engine's counters failed")
            return None

    # --- on the engine thread -------------------------------------------------------------------------
    def _stats_into(self, fut: concurrent.futures.Future) -> None:
        try:
            fut.set_result(self._engine.stats())
        except Exception as e:  # the scraping thread gets it
            fut.set_exception(e)

    def _info(self, key: Hashable) -> SessionInfo:
        return self._engine.session_info(key)

    def _start_turn(self, key: str, turn: TurnSpec, new_session: bool, stream: TurnStream) -> None:
        eng = self._engine
        if not new_session:
            stream.prunes_before = len(eng.session_info(key).prune_log)
        eng.submit_turn(key, turn)
        self._thread.register(key, functools.partial(self._deliver, stream))

    def _deliver(self, stream: TurnStream, out: RequestOutput | BaseException) -> None:
        """The engine loop's sink for ``stream``: one output, converted here, on the engine thread."""
        if isinstance(out, BaseException):
            stream.push(out)
            return
        delta = TurnDelta(text=out.new_text, token_ids=tuple(out.new_token_ids), last=out.finished)
        result = None
        if out.finished:
            try:
                info = self._info(stream.key)
            except SessionNotFound:
                info = None
            result = TurnResult(
                finish_reason=out.finish_reason or "stop",
                error=out.error,
                token_ids=tuple(out.token_ids),
                prompt_tokens=stream.prompt_tokens,
                reused_tokens=out.counters.reused_tokens,
                prefilled_tokens=out.counters.prefilled_tokens,
                time_to_first_token=out.time_to_first_token,
                source_tier=out.source_tier,
                timing=out.timing,
                session=info,
                new_prunes=info.prune_log[stream.prunes_before :] if info is not None else (),
            )
        stream.push((delta, result))

    def _span_kv_tokens(self, key: str) -> tuple[float, ...] | None:
        kept = self._engine.span_kv_tokens(key)
        return None if kept is None else tuple(kept)

    def _release_turn(self, key: str) -> SessionInfo | None:
        eng = self._engine
        self._thread.unregister(key)
        eng.abort(key)  # rolls a running turn back; nothing when it finished or never started
        try:
            info = self._info(key)
        except SessionNotFound:
            return None
        if info.is_empty:  # a new session's first turn: nothing left worth keeping
            eng.end_session(key)
            return None
        return info

    def _end_session(self, key: str) -> bool:
        try:
            self._engine.end_session(key)
        except SessionNotFound:
            return False
        return True

    def _fork(self, key: str, child_key: str) -> SessionInfo:
        self._engine.fork_session(key, child_key)
        return self._info(child_key)

    def _load(self, snapshot: SessionSnapshot) -> SessionInfo:
        self._engine.load_session(snapshot)
        return self._info(snapshot.meta["session_id"])

    def _prune(self, key: str, spec: PruneSpec) -> PruneResult:
        check_policy(spec.policy, spec.keep_ratio, spec.scope)  # also when the rule selects no span
        info = self._info(key)
        if spec.span is not None:
            check_span(*spec.span, info.num_tokens)
            spans = [spec.span]
        else:
            roles = spec.roles or self.model.prune_roles
            lag = spec.lag if spec.lag is not None else (self.model.prune_lag or 0)
            spans = [(a, b) for a, b, _ in due_spans(info.spans, info.turn_index, roles, lag=lag)]
        policy = dict(policy=spec.policy, keep_ratio=spec.keep_ratio, scope=spec.scope)
        removed = sum(self._engine.prune_history(key, a, b, **policy) for a, b in spans)
        return PruneResult(removed=removed, pruned_tokens=sum(b - a for a, b in spans), session=self._info(key))
