"""Pruning a session's history KV between turns: the one path gRPC PruneHistory and the HTTP front's
``/v1/prefix_cache/prune`` share.

The session is taken as a turn takes it (a turn, a fork or another pruning meanwhile is refused as
busy), each span is pruned on the engine (``EngineClient.prune``: the engine's rule checks it
against the history), and when anything was pruned the session's record is refreshed, its snapshot
marked dirty and the hooks told. The session is released whatever happens.
"""

from __future__ import annotations

from engine.api import SessionNotFound
from sidecar.engine_bridge.client import EngineClient, PruneSpec
from sidecar.engine_bridge.results import PruneResult
from sidecar.session_ids import SessionKey
from sidecar.sessions.manager import SessionManager
from sidecar.turns.hooks import ServerHooks


async def prune_session(
    sessions: SessionManager,
    client: EngineClient,
    key: str,
    specs: list[PruneSpec],
    *,
    hooks: ServerHooks,
    deadline: float | None = None,
) -> PruneResult:
    """Prune ``specs`` in order on session ``key``; the totals, with the session as it stands after.
    Raises SessionNotFound, SessionBusy, PruneRuleError (a span outside the history)."""
    s = await sessions.get_settled(key, create=False, deadline=deadline)
    if not s.in_engine:
        raise SessionNotFound(f"no session {SessionKey.id_of(key)!r}")
    running = sessions.begin_turn(s, "")
    removed = pruned = 0
    result = None
    try:
        for spec in specs:
            result = await client.prune(key, spec)
            removed += result.removed
            pruned += result.pruned_tokens
    finally:
        sessions.end_turn(s, running, None)
        if pruned:
            info = result.session if result is not None else await client.session_info(key)
            s.update(info, sessions.end_of_turn_id)
            sessions.mark_dirty(key)
            hooks.on_prune(pruned, removed)
    session = result.session if result is not None else await client.session_info(key)
    return PruneResult(removed=removed, pruned_tokens=pruned, session=session)
