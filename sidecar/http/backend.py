"""The HTTP front's one way onto the sidecar's sessions (the seam to swap for an engine client).

A turn from either OpenAI API becomes a typed ``sidecar.turns.request.TurnRequest`` run by the
sidecar's ``TurnRunner`` (over its ``EngineClient``), as gRPC's Turn is, so both fronts share everything behind it: tenant-scoped session keys, quotas, loading a
session from the store, rendering only the new messages, structured output, streaming, rolling back a
turn whose caller went away, and write-behind snapshots. The bearer token is checked by the same
``Authenticator`` as gRPC metadata, so an HTTP token and a gRPC token of one tenant see the same
sessions and nothing else.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import TYPE_CHECKING, AsyncIterator, Mapping

from engine.api import SessionInfo
from sidecar._proto.chainkv.v1 import sidecar_pb2 as pb
from sidecar.engine_bridge.client import PruneSpec
from sidecar.engine_bridge.results import PruneResult
from sidecar.grpc.errors import Draining
from sidecar.http.errors import invalid
from sidecar.session_ids import scoped_key
from sidecar.sessions.record import Session
from sidecar.store.record import StoredSession
from sidecar.store.transcript_index import Found, StoredTranscripts
from sidecar.turns.prune import prune_session
from sidecar.turns.request import TurnRequest
from sidecar.turns.structured import OutputSpecError

log = logging.getLogger(__name__)

if TYPE_CHECKING:  # pragma: no cover
    from sidecar.grpc.sidecar_server import SidecarServer


class SessionBackend:
    def __init__(self, server: "SidecarServer", model_name: str):
        self.server = server
        self.engine = server.engine
        self.model_name = model_name

    # --- callers ------------------------------------------------------------------------------------
    def tenant(self, authorization: str | None) -> str:
        """The caller's tenant (raises Unauthenticated); the gRPC front's rules."""
        if self.server.draining:
            raise Draining("the sidecar is shutting down; retry on another replica")
        return self.server.options.auth.tenant([("authorization", authorization)] if authorization else [])

    # --- turns --------------------------------------------------------------------------------------
    async def turn(
        self,
        authorization: str | None,
        request: TurnRequest,
        on_complete=None,
        fields: Mapping[str, str] | None = None,
    ) -> AsyncIterator[pb.TurnEvent]:
        """Run one turn: its TextDelta / ToolCall events, then its TurnCompletion (errors raise).
        ``on_complete(session, completion)``: called before the turn's snapshot is taken. ``fields``:
        this API's names of the request fields whose gRPC names differ (``response_format`` is the
        Responses API's ``text.format``), for the ``param`` of a structured-output error."""
        tenant = self.tenant(authorization)
        self.server.client.check_serving()
        turn = self.server.turns.run(tenant, request, None, on_complete)
        try:
            async with contextlib.aclosing(turn):  # closed with this one: its turn is released at once
                async for event in turn:
                    yield event
        except OutputSpecError as e:  # a schema, tool or tool_choice the grammar cannot be built from
            param = (fields or {}).get(e.field, e.field)
            raise invalid(f"{param}: {e}", param) from None

    # --- sessions -----------------------------------------------------------------------------------
    def key(self, tenant: str, session_id: str) -> str:
        return scoped_key(tenant, session_id)

    def local(self, key: str) -> Session | None:
        return self.server.sessions.local(key)

    async def find(self, key: str) -> Session | None:
        """The session here, or loaded from the store; None when it exists nowhere."""
        s = self.server.sessions.local(key)
        if s is not None and s.in_engine:
            return s
        try:
            s = await self.server.sessions.get(key, create=False)
        except Exception as e:  # noqa: BLE001 - only "not found" means None; the rest is the caller's error
            from engine.api import SessionNotFound

            if isinstance(e, SessionNotFound):
                return None
            raise
        return s if s.in_engine else None

    async def find_newer(self, key: str, at_least: int) -> Session | None:
        """The store's copy of the session when it is at ``at_least`` turns or more, that is ahead of this
        replica's (another replica ran the later turns); None when the store has nothing that far."""
        from engine.api import SessionError
        from sidecar.store.errors import StoreError

        if not self.server.sessions.has_store:
            return None
        try:
            stored = await self.server.sessions.stored(key)
            target = max(at_least, stored.turn_index if stored is not None else 0)
            s = await self.server.sessions.get(key, create=False, expected_turn_index=target)
        except (SessionError, StoreError) as e:
            log.info("session %s: no copy at turn %d or later in the store (%s)", key, at_least, e)
            return None
        return s if s.in_engine and s.turn_index >= at_least else None

    def was_ended(self, key: str) -> bool:
        """The session was ended (or expired with nothing stored) on this replica."""
        return key in self.server.sessions.ended

    async def end(self, key: str, keep_snapshot: bool = False) -> None:
        from engine.api import SessionNotFound

        try:
            await self.server.sessions.end(key, keep_snapshot)
        except SessionNotFound:
            pass

    async def front_changed(self, s: Session) -> None:
        """``s.front`` changed between turns (a deleted response): the store gets it at the session's
        generation; with durability sync before this returns (StoreUnavailable if it could not be
        written), else behind it. A running turn's own snapshot carries it instead."""
        from sidecar.store.errors import StoreUnavailable

        s.front_changed()
        if self.server.options.durability != "sync" or s.busy:
            self.server.sessions.mark_dirty(s.key)
            return
        await self.server.sessions.write_now(s.key)
        if s.snapshot_pending:
            raise StoreUnavailable(f"the change was not written to the store ({s.snapshot_error}); retry")

    # --- cache control ------------------------------------------------------------------------------
    async def session_info(self, key: str) -> SessionInfo:
        return await self.server.client.session_info(key)

    async def span_kv_tokens(self, key: str) -> tuple[float, ...] | None:
        return await self.server.client.span_kv_tokens(key)

    async def stored(self, key: str) -> StoredSession | None:
        """The store's committed record of the session (no KV); None without a store or a record."""
        return await self.server.sessions.stored(key)

    async def end_session(self, key: str) -> tuple[bool, bool]:
        """End the session here and delete it from the store: (ended here, deleted from the store).
        Raises SessionNotFound when it was nowhere."""
        return await self.server.sessions.end(key, False)

    async def set_eviction_priority(self, s: Session, priority: int) -> None:
        """Record it with the session (its snapshot carries it) and tell the engine."""
        s.eviction_priority = priority
        await self.server.client.set_eviction_priority(s.key, priority)
        await self.front_changed(s)

    async def prune(self, key: str, specs: list[PruneSpec]) -> PruneResult:
        server = self.server
        return await prune_session(server.sessions, server.client, key, specs, hooks=server.hooks)

    # --- the transcript index in the store -----------------------------------------------------------
    def stored_transcripts(self, front_key: str, turn_key: str) -> StoredTranscripts | None:
        """The store's transcript index (sidecar/store/transcript_index.py), fed by each committed snapshot;
        None without a store (or a writer, or for a store kind without an index: this replica's memory only)."""
        return self.server.sessions.transcripts(front_key, turn_key)

    async def find_transcript(self, index: StoredTranscripts, tenant: str, digests: list[bytes]) -> Found | None:
        """``index.find`` off the event loop; a store that cannot be reached finds nothing."""
        from sidecar.store.errors import StoreError, StoreUnavailable

        try:
            return await asyncio.to_thread(index.find, tenant, digests)
        except StoreUnavailable as e:  # logged once a minute while the store is down
            self.server.store_failed(e, "reading the transcript index (a new session was started)")
            return None
        except StoreError as e:
            log.warning("the store's transcript index cannot be read (%s); starting a new session", e)
            return None


async def prepend(first, rest: AsyncIterator):
    """``first``, then the items of ``rest`` (closed with this generator)."""
    try:
        yield first
        async for item in rest:
            yield item
    finally:
        await rest.aclose()
