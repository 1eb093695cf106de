"""What both framework adapters do per call: pick the session, send only its unseen messages, stream.

``Conversations.stream(key, messages, tools, options)`` plans the turn with the ``SessionLedger``
(a key the process has no record of is checked against the sidecar first), sends the new messages
(tools and method settings only on a session's first turn: the sidecar fixes them there), yields
the client's events and records the reply. ``key=None`` is a stateless call: a throwaway session
that is ended afterwards. A conversation whose history was edited moves to a fresh session, and
the session it leaves is ended (its KV and snapshot freed) once the fresh one answered.

A turn the sidecar refuses because its session holds fewer turns than the ledger recorded (they
were lost: ``ChainKVError.session_turn_index``) is sent again at once as the catch-up turn
``SessionLedger.recover`` plans (every message after the turns the session still holds), so the
framework's next call simply succeeds; the reply is the one an uninterrupted session would give
(greedy decoding) as long as the messages re-sent render to the tokens the session had.
"""

from __future__ import annotations

import asyncio
import uuid
import weakref
from typing import Any, AsyncIterator, Iterator, Sequence

import grpc

from agent_adapters.client import AsyncChainKVClient, ChainKVClient, ChainKVError, RetryPolicy
from agent_adapters.ledger import Plan, SessionLedger
from agent_adapters.messages import ChatMessage, ToolSpec, TurnEvent, TurnResult
from agent_adapters.turns import METHOD_FIELDS, SAMPLING_FIELDS


NOT_MODEL_SETTINGS = ("ignore_eos", "method_args", "shared_prefix_messages")
"""Client fields the framework models do not declare as settings (``method_args`` is passed on its own)."""
TURN_SETTINGS = tuple(n for n in SAMPLING_FIELDS + METHOD_FIELDS if n not in NOT_MODEL_SETTINGS)
"""The sampling and method fields both framework models declare under the client's names."""


def turn_options(model: Any, **overrides: Any) -> dict[str, Any]:
    """A framework model's per-turn options for ``Conversations``: its ``TURN_SETTINGS`` fields and
    ``method_args``, no response format or tool choice, then ``overrides``."""
    options = {name: getattr(model, name) for name in TURN_SETTINGS}
    options.update(method_args=model.method_args or None, response_format=None, tool_choice=None)
    options.update(overrides)
    return options


class Conversations:
    def __init__(
        self,
        target: str,
        *,
        token: str | None = None,
        tls_ca: str | None = None,
        timeout_s: float | None = 300.0,
        retry: RetryPolicy | None = None,
    ):
        self.target, self.token, self.tls_ca, self.timeout_s, self.retry = target, token, tls_ca, timeout_s, retry
        self.ledger = SessionLedger()
        self._client: ChainKVClient | None = None
        self._aclients: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, AsyncChainKVClient]" = (
            weakref.WeakKeyDictionary()
        )

    @classmethod
    def from_settings(cls, settings) -> "Conversations":
        """From an adapter's connection fields (``target``, ``token``, ``tls_ca``, ``timeout_s``,
        ``max_retries``: the same names in every adapter; ``token`` a string or a pydantic SecretStr)."""
        token = settings.token
        return cls(
            settings.target,
            token=token.get_secret_value() if hasattr(token, "get_secret_value") else token,
            tls_ca=settings.tls_ca,
            timeout_s=settings.timeout_s,
            retry=RetryPolicy(max_attempts=settings.max_retries + 1),
        )

    # --- clients --------------------------------------------------------------------------------
    @property
    def client(self) -> ChainKVClient:
        if self._client is None:
            self._client = ChainKVClient(
                self.target, token=self.token, tls_ca=self.tls_ca, timeout_s=self.timeout_s, retry=self.retry
            )
        return self._client

    def aclient(self) -> AsyncChainKVClient:
        """The asyncio client of the running loop (a grpc.aio channel belongs to one loop)."""
        loop = asyncio.get_running_loop()
        c = self._aclients.get(loop)
        if c is None:
            c = self._aclients[loop] = AsyncChainKVClient(
                self.target, token=self.token, tls_ca=self.tls_ca, timeout_s=self.timeout_s, retry=self.retry
            )
        return c

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None

    # --- planning -------------------------------------------------------------------------------
    def _plan(self, key: str | None, messages: Sequence[ChatMessage]) -> Plan:
        if key is None:
            return Plan("", f"eph-{uuid.uuid4().hex}", list(messages), True, True)
        return self.ledger.plan(key, messages)

    @staticmethod
    def _options(plan: Plan, tools: Sequence[ToolSpec], options: dict[str, Any]) -> dict[str, Any]:
        opts = {k: v for k, v in options.items() if v is not None}
        if not plan.first:
            opts = {k: v for k, v in opts.items() if k not in METHOD_FIELDS}
        opts["tools"] = list(tools) if plan.first else []
        opts.setdefault("expected_turn_index", plan.expected_turn_index)
        return opts

    def _recovered(self, plan: Plan, messages: Sequence[ChatMessage], e: ChainKVError) -> Plan | None:
        """The catch-up plan when ``e`` refused ``plan`` because its session lost turns; else None."""
        if e.code is not grpc.StatusCode.FAILED_PRECONDITION or e.session_turn_index is None or not plan.key:
            return None
        return self.ledger.recover(plan, messages, e.session_turn_index)

    # --- sync -------------------------------------------------------------------------------------
    def stream(
        self, key: str | None, messages: Sequence[ChatMessage], tools: Sequence[ToolSpec] = (), **options: Any
    ) -> Iterator[TurnEvent]:
        plan = self._plan(key, messages)
        if not plan.known and self._exists(plan.session_id):
            plan = self.ledger.rotate(plan)
        try:
            while True:
                started = False
                try:
                    for event in self.client.stream_turn(
                        plan.session_id, plan.messages, **self._options(plan, tools, options)
                    ):
                        started = True
                        if isinstance(event, TurnResult) and key is not None:
                            self.ledger.record(plan, event)
                            if plan.replaces:
                                self._end_quietly(plan.replaces)
                        yield event
                    return
                except ChainKVError as e:
                    again = None if started else self._recovered(plan, messages, e)
                    if again is None:
                        raise
                    plan = again
        finally:
            if key is None:
                self._end_quietly(plan.session_id)

    def _exists(self, session_id: str) -> bool:
        try:
            self.client.get_session(session_id)
            return True
        except ChainKVError as e:
            if e.code is grpc.StatusCode.NOT_FOUND:
                return False
            raise

    def _end_quietly(self, session_id: str) -> None:
        try:
            self.client.end_session(session_id)
        except ChainKVError:
            pass

    # --- asyncio ------------------------------------------------------------------------------------
    async def astream(
        self, key: str | None, messages: Sequence[ChatMessage], tools: Sequence[ToolSpec] = (), **options: Any
    ) -> AsyncIterator[TurnEvent]:
        client = self.aclient()
        plan = self._plan(key, messages)
        if not plan.known and await self._aexists(client, plan.session_id):
            plan = self.ledger.rotate(plan)
        try:
            while True:
                started = False
                try:
                    async for event in client.stream_turn(
                        plan.session_id, plan.messages, **self._options(plan, tools, options)
                    ):
                        started = True
                        if isinstance(event, TurnResult) and key is not None:
                            self.ledger.record(plan, event)
                            if plan.replaces:
                                await self._aend_quietly(client, plan.replaces)
                        yield event
                    return
                except ChainKVError as e:
                    again = None if started else self._recovered(plan, messages, e)
                    if again is None:
                        raise
                    plan = again
        finally:
            if key is None:
                await self._aend_quietly(client, plan.session_id)

    @staticmethod
    async def _aend_quietly(client: AsyncChainKVClient, session_id: str) -> None:
        try:
            await client.end_session(session_id)
        except ChainKVError:
            pass

    @staticmethod
    async def _aexists(client: AsyncChainKVClient, session_id: str) -> bool:
        try:
            await client.get_session(session_id)
            return True
        except ChainKVError as e:
            if e.code is grpc.StatusCode.NOT_FOUND:
                return False
            raise


__all__ = ["Conversations"]
