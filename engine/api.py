"""The engine's front door for the sidecar: every engine name a server needs, and nothing else.

The sidecar imports the engine only through this module (and ``engine.config`` and the
tensor-parallel launcher, which build it); tests/test_import_cycles.py enforces that. What crosses
here is typed:

- in: ``TurnSpec`` (one turn: its tokens, ``SamplingParams``, ``MethodSpec``, spans, hints, ...),
  a ``MethodSpec`` (the one spelling of the method settings: ``MethodSpec.field_names()``) and
  ``SessionSnapshot`` to load;
- out: ``SessionInfo`` (with its ``SpanInfo`` and ``PruneRecord`` tuples and its last turn's
  ``RecallTraffic``), ``RequestOutput`` per
  step, ``ModelInfo``, ``EngineStats`` and ``SessionSnapshot`` to store;
- the errors a request can cause, each a type a server maps to a status (sidecar/grpc/errors.py).

    engine = LLMEngine(EngineConfig(method="snapkv", budget=256))
    engine.submit_turn("s", TurnSpec(tokens, SamplingParams(max_tokens=32), role="user"))
    while engine.has_unfinished():
        for out in engine.step(): ...
    info = engine.session_info("s")          # SessionInfo
"""

from __future__ import annotations

from engine.cache.snapshot import SessionSnapshot, SnapshotError
from engine.chain import (
    KV_STATE_KEYS,
    MAX_PRIORITY,
    ContextFull,
    HistoryMismatch,
    InvalidHint,
    PinLimit,
    PruneRecord,
    SessionBusy,
    SessionError,
    SessionExists,
    SessionHints,
    SessionInfo,
    SessionNotFound,
    SpanInfo,
    Tier,
    TurnIndexMismatch,
    TurnSpec,
)
from engine.constrained import Constraint, ConstraintError
from engine.method_spec import MethodError, MethodSpec, build_params
from engine.llm import LLMEngine
from engine.methods import REGISTRY as METHODS
from engine.methods import describe as describe_methods
from engine.methods import get_method_class
from engine.methods.duo_calibration import calibrate as calibrate_duo, write_pattern as write_duo_pattern
from engine.model.loader import ModelLoadError, cache_root
from engine.prune_rule import PruneRuleError, check_policy, check_span, due_spans
from engine.recall import RecallTraffic
from engine.reports import EngineStats, ModelInfo
from engine.requests import CapacityError, RequestError
from engine.sampling import SamplingError, SamplingParams
from engine.sequence import RequestOutput
from engine.turn_timing import TurnTiming

__all__ = [
    "KV_STATE_KEYS",
    "MAX_PRIORITY",
    "METHODS",
    "CapacityError",
    "Constraint",
    "ConstraintError",
    "ContextFull",
    "EngineStats",
    "HistoryMismatch",
    "InvalidHint",
    "LLMEngine",
    "MethodError",
    "MethodSpec",
    "ModelInfo",
    "ModelLoadError",
    "PinLimit",
    "PruneRecord",
    "PruneRuleError",
    "RecallTraffic",
    "RequestError",
    "RequestOutput",
    "SamplingError",
    "SamplingParams",
    "SessionBusy",
    "SessionError",
    "SessionExists",
    "SessionHints",
    "SessionInfo",
    "SessionNotFound",
    "SessionSnapshot",
    "SnapshotError",
    "SpanInfo",
    "Tier",
    "TurnIndexMismatch",
    "TurnSpec",
    "TurnTiming",
    "build_params",
    "cache_root",
    "calibrate_duo",
    "check_policy",
    "check_span",
    "describe_methods",
    "due_spans",
    "get_method_class",
    "write_duo_pattern",
]
