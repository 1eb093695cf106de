"""Exceptions -> gRPC status codes: the one table every RPC's failure goes through.

The engine and the sidecar raise typed errors (a bad request, a busy or missing session, a full KV
pool, a store that is down); ``status_for`` picks the code a client can act on. Order matters:
the first row whose types match wins, so subclasses come before their bases. Anything not listed
is a bug and maps to INTERNAL (and is logged with its traceback by the caller).
"""

from __future__ import annotations

import grpc

from engine.api import (
    CapacityError,
    ConstraintError,
    ContextFull,
    InvalidHint,
    MethodError,
    PinLimit,
    PruneRuleError,
    RequestError,
    SamplingError,
    SessionBusy,
    SessionError,
    SessionExists,
    SessionNotFound,
    TurnIndexMismatch,
)
from engine.config import ConfigError
from sidecar._proto.chainkv.v1 import sidecar_pb2 as pb
from sidecar.engine_bridge.client import EngineFailed
from sidecar.grpc.auth import Unauthenticated
from sidecar.session_ids import BadSessionId
from sidecar.store.errors import SnapshotRolledBack, StoreUnavailable
from sidecar.store.integrity import SnapshotRejected
from sidecar.turns.chat import ChatError
from sidecar.turns.errors import TurnAborted
from sidecar.turns.limits import QuotaExceeded, TurnTooLarge
from sidecar.turns.protocol import InvalidRequest
from sidecar.turns.structured import OutputSpecError


class Draining(RuntimeError):
    """The server is shutting down (UNAVAILABLE: retry on another replica)."""


_CODES: list[tuple[type[BaseException] | tuple[type[BaseException], ...], grpc.StatusCode]] = [
    (Unauthenticated, grpc.StatusCode.UNAUTHENTICATED),
    ((QuotaExceeded, PinLimit), grpc.StatusCode.RESOURCE_EXHAUSTED),
    ((SnapshotRejected, SnapshotRolledBack), grpc.StatusCode.DATA_LOSS),
    (
        (
            InvalidRequest,
            TurnTooLarge,
            BadSessionId,
            ChatError,
            MethodError,
            SamplingError,
            ConfigError,
            ContextFull,
            InvalidHint,
            PruneRuleError,
            OutputSpecError,
            ConstraintError,
        ),
        grpc.StatusCode.INVALID_ARGUMENT,
    ),
    (SessionNotFound, grpc.StatusCode.NOT_FOUND),
    (SessionExists, grpc.StatusCode.ALREADY_EXISTS),
    ((SessionBusy, TurnAborted), grpc.StatusCode.ABORTED),
    (CapacityError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (SessionError, grpc.StatusCode.FAILED_PRECONDITION),
    (RequestError, grpc.StatusCode.INVALID_ARGUMENT),
    ((StoreUnavailable, Draining, EngineFailed), grpc.StatusCode.UNAVAILABLE),
]


def status_for(e: BaseException) -> grpc.StatusCode:
    """The status code a failed RPC answers with for ``e``."""
    for kinds, code in _CODES:
        if isinstance(e, kinds):
            return code
    return grpc.StatusCode.INTERNAL


TURN_INDEX_CONFLICT_KEY = pb.TurnIndexConflict.DESCRIPTOR.full_name.lower() + "-bin"
"""The trailing-metadata key of a refused turn's ``TurnIndexConflict`` (named in the proto)."""


def trailing_metadata_for(e: BaseException) -> tuple[tuple[str, bytes], ...]:
    """What a failed RPC sends in its trailing metadata for ``e``: a ``TurnIndexConflict`` (the turns
    the session really holds) when ``e`` refused an expected_turn_index, else nothing."""
    if isinstance(e, TurnIndexMismatch) and e.turn_index is not None:
        detail = pb.TurnIndexConflict(session_turn_index=e.turn_index, expected_turn_index=e.expected or 0)
        return ((TURN_INDEX_CONFLICT_KEY, detail.SerializeToString()),)
    return ()
