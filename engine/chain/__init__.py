"""Session chains (the Chain Cache): records, tier moves, the snapshot record, errors.

``ChainCache`` (cache.py) runs turns, forks, pruning and snapshots; ``ChainTiers`` (tiers.py)
moves chains between the GPU, host RAM and the history alone; ``records.py`` holds the Chain
record and its states; ``codec.py`` the session record a snapshot carries; ``errors.py`` the
session errors.
"""

from engine.chain.cache import ChainCache
from engine.chain.codec import KV_STATE_KEYS
from engine.chain.errors import (
    ContextFull,
    HistoryMismatch,
    SessionBusy,
    SessionError,
    SessionExists,
    SessionNotFound,
    TurnIndexMismatch,
)
from engine.chain.records import Chain, ChainState, TaggedSpan, Tier, history_digest
from engine.chain.tiers import ChainTiers

__all__ = [
    "KV_STATE_KEYS",
    "Chain",
    "ChainCache",
    "ChainState",
    "ChainTiers",
    "ContextFull",
    "HistoryMismatch",
    "SessionBusy",
    "SessionError",
    "SessionExists",
    "SessionNotFound",
    "TaggedSpan",
    "Tier",
    "TurnIndexMismatch",
    "history_digest",
]
