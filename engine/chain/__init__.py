"""Session chains (the Chain Cache): records, tier moves, the snapshot record, errors.

``ChainCache`` (cache.py) runs turns, forks, pruning and snapshots; ``ChainTiers`` (tiers.py)
moves chains between the GPU, host RAM and the history alone; ``records.py`` holds the Chain
record and its states; ``codec.py`` the session record a snapshot carries; ``hints.py`` the agent
hints (priority, pin, release); ``errors.py`` the session errors; ``turn_spec.py`` what a turn
asks for (``TurnSpec``) and ``info.py`` what the cache reports about a session (``SessionInfo``).
"""

from engine.chain.cache import ChainCache
from engine.chain.codec import KV_STATE_KEYS
from engine.chain.errors import (
    ContextFull,
    HistoryMismatch,
    InvalidHint,
    PinLimit,
    SessionBusy,
    SessionError,
    SessionExists,
    SessionNotFound,
    TurnIndexMismatch,
)
from engine.chain.hints import MAX_PRIORITY, SessionHints
from engine.chain.info import SessionInfo, SpanInfo
from engine.chain.records import Chain, ChainState, PruneRecord, TaggedSpan, Tier, history_digest
from engine.chain.tiers import ChainTiers
from engine.chain.turn_spec import TurnSpec

__all__ = [
    "KV_STATE_KEYS",
    "Chain",
    "ChainCache",
    "ChainState",
    "ChainTiers",
    "ContextFull",
    "HistoryMismatch",
    "InvalidHint",
    "MAX_PRIORITY",
    "PinLimit",
    "PruneRecord",
    "SessionBusy",
    "SessionError",
    "SessionExists",
    "SessionHints",
    "SessionInfo",
    "SessionNotFound",
    "SpanInfo",
    "TaggedSpan",
    "Tier",
    "TurnIndexMismatch",
    "TurnSpec",
    "history_digest",
]
