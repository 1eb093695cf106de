from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_TOOL_CALLS: _ClassVar[FinishReason]

class Tier(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TIER_UNSPECIFIED: _ClassVar[Tier]
    TIER_NEW: _ClassVar[Tier]
    TIER_GPU: _ClassVar[Tier]
    TIER_HOST: _ClassVar[Tier]
    TIER_STORE: _ClassVar[Tier]
    TIER_RECOMPUTE: _ClassVar[Tier]

class SessionState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SESSION_STATE_UNSPECIFIED: _ClassVar[SessionState]
    SESSION_STATE_ACTIVE: _ClassVar[SessionState]
    SESSION_STATE_IDLE: _ClassVar[SessionState]
    SESSION_STATE_HOST: _ClassVar[SessionState]
    SESSION_STATE_HISTORY: _ClassVar[SessionState]
    SESSION_STATE_STORED: _ClassVar[SessionState]

class SnapshotState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SNAPSHOT_STATE_UNSPECIFIED: _ClassVar[SnapshotState]
    SNAPSHOT_STATE_COMMITTED: _ClassVar[SnapshotState]
    SNAPSHOT_STATE_PENDING: _ClassVar[SnapshotState]
    SNAPSHOT_STATE_CONFLICT: _ClassVar[SnapshotState]
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_TOOL_CALLS: FinishReason
TIER_UNSPECIFIED: Tier
TIER_NEW: Tier
TIER_GPU: Tier
TIER_HOST: Tier
TIER_STORE: Tier
TIER_RECOMPUTE: Tier
SESSION_STATE_UNSPECIFIED: SessionState
SESSION_STATE_ACTIVE: SessionState
SESSION_STATE_IDLE: SessionState
SESSION_STATE_HOST: SessionState
SESSION_STATE_HISTORY: SessionState
SESSION_STATE_STORED: SessionState
SNAPSHOT_STATE_UNSPECIFIED: SnapshotState
SNAPSHOT_STATE_COMMITTED: SnapshotState
SNAPSHOT_STATE_PENDING: SnapshotState
SNAPSHOT_STATE_CONFLICT: SnapshotState

class Message(_message.Message):
    __slots__ = ("role", "content", "name", "tool_call_id", "tool_calls")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALL_ID_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    name: str
    tool_call_id: str
    tool_calls: _containers.RepeatedCompositeFieldContainer[ToolCall]
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ..., name: _Optional[str] = ..., tool_call_id: _Optional[str] = ..., tool_calls: _Optional[_Iterable[_Union[ToolCall, _Mapping]]] = ...) -> None: ...

class Tool(_message.Message):
    __slots__ = ("name", "description", "parameters_json")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    PARAMETERS_JSON_FIELD_NUMBER: _ClassVar[int]
    name: str
    description: str
    parameters_json: str
    def __init__(self, name: _Optional[str] = ..., description: _Optional[str] = ..., parameters_json: _Optional[str] = ...) -> None: ...

class ToolCall(_message.Message):
    __slots__ = ("id", "name", "arguments_json")
    ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    ARGUMENTS_JSON_FIELD_NUMBER: _ClassVar[int]
    id: str
    name: str
    arguments_json: str
    def __init__(self, id: _Optional[str] = ..., name: _Optional[str] = ..., arguments_json: _Optional[str] = ...) -> None: ...

class TurnIndexConflict(_message.Message):
    __slots__ = ("session_turn_index", "expected_turn_index")
    SESSION_TURN_INDEX_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_TURN_INDEX_FIELD_NUMBER: _ClassVar[int]
    session_turn_index: int
    expected_turn_index: int
    def __init__(self, session_turn_index: _Optional[int] = ..., expected_turn_index: _Optional[int] = ...) -> None: ...

class TurnRequest(_message.Message):
    __slots__ = ("session_id", "request_id", "messages", "tools", "expected_turn_index", "max_tokens", "temperature", "top_k", "top_p", "seed", "stop", "ignore_eos", "presence_penalty", "frequency_penalty", "repetition_penalty", "method", "budget", "budget_ratio", "method_args", "shared_prefix_messages", "public_prefix", "response_format", "tool_choice", "agent_hints", "session_control")
    class MethodArgsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    TOOLS_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_TURN_INDEX_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    METHOD_FIELD_NUMBER: _ClassVar[int]
    BUDGET_FIELD_NUMBER: _ClassVar[int]
    BUDGET_RATIO_FIELD_NUMBER: _ClassVar[int]
    METHOD_ARGS_FIELD_NUMBER: _ClassVar[int]
    SHARED_PREFIX_MESSAGES_FIELD_NUMBER: _ClassVar[int]
    PUBLIC_PREFIX_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_FORMAT_FIELD_NUMBER: _ClassVar[int]
    TOOL_CHOICE_FIELD_NUMBER: _ClassVar[int]
    AGENT_HINTS_FIELD_NUMBER: _ClassVar[int]
    SESSION_CONTROL_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    request_id: str
    messages: _containers.RepeatedCompositeFieldContainer[Message]
    tools: _containers.RepeatedCompositeFieldContainer[Tool]
    expected_turn_index: int
    max_tokens: int
    temperature: float
    top_k: int
    top_p: float
    seed: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    ignore_eos: bool
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    method: str
    budget: int
    budget_ratio: float
    method_args: _containers.ScalarMap[str, str]
    shared_prefix_messages: int
    public_prefix: bool
    response_format: ResponseFormat
    tool_choice: ToolChoice
    agent_hints: AgentHints
    session_control: SessionControl
    def __init__(self, session_id: _Optional[str] = ..., request_id: _Optional[str] = ..., messages: _Optional[_Iterable[_Union[Message, _Mapping]]] = ..., tools: _Optional[_Iterable[_Union[Tool, _Mapping]]] = ..., expected_turn_index: _Optional[int] = ..., max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., seed: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., ignore_eos: _Optional[bool] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., method: _Optional[str] = ..., budget: _Optional[int] = ..., budget_ratio: _Optional[float] = ..., method_args: _Optional[_Mapping[str, str]] = ..., shared_prefix_messages: _Optional[int] = ..., public_prefix: _Optional[bool] = ..., response_format: _Optional[_Union[ResponseFormat, _Mapping]] = ..., tool_choice: _Optional[_Union[ToolChoice, _Mapping]] = ..., agent_hints: _Optional[_Union[AgentHints, _Mapping]] = ..., session_control: _Optional[_Union[SessionControl, _Mapping]] = ...) -> None: ...

class AgentHints(_message.Message):
    __slots__ = ("priority", "expected_return_s")
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_RETURN_S_FIELD_NUMBER: _ClassVar[int]
    priority: int
    expected_return_s: float
    def __init__(self, priority: _Optional[int] = ..., expected_return_s: _Optional[float] = ...) -> None: ...

class SessionControl(_message.Message):
    __slots__ = ("action", "ttl_seconds")
    ACTION_FIELD_NUMBER: _ClassVar[int]
    TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    action: str
    ttl_seconds: float
    def __init__(self, action: _Optional[str] = ..., ttl_seconds: _Optional[float] = ...) -> None: ...

class ResponseFormat(_message.Message):
    __slots__ = ("type", "json_schema", "regex", "grammar")
    TYPE_FIELD_NUMBER: _ClassVar[int]
    JSON_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    REGEX_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    type: str
    json_schema: str
    regex: str
    grammar: str
    def __init__(self, type: _Optional[str] = ..., json_schema: _Optional[str] = ..., regex: _Optional[str] = ..., grammar: _Optional[str] = ...) -> None: ...

class ToolChoice(_message.Message):
    __slots__ = ("mode", "function_name")
    MODE_FIELD_NUMBER: _ClassVar[int]
    FUNCTION_NAME_FIELD_NUMBER: _ClassVar[int]
    mode: str
    function_name: str
    def __init__(self, mode: _Optional[str] = ..., function_name: _Optional[str] = ...) -> None: ...

class TurnEvent(_message.Message):
    __slots__ = ("delta", "tool_call", "completion")
    DELTA_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALL_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_FIELD_NUMBER: _ClassVar[int]
    delta: TextDelta
    tool_call: ToolCall
    completion: TurnCompletion
    def __init__(self, delta: _Optional[_Union[TextDelta, _Mapping]] = ..., tool_call: _Optional[_Union[ToolCall, _Mapping]] = ..., completion: _Optional[_Union[TurnCompletion, _Mapping]] = ...) -> None: ...

class TextDelta(_message.Message):
    __slots__ = ("text", "token_ids")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "reused_tokens", "prefilled_tokens", "pruned_tokens", "generated_tokens", "time_to_first_token_s", "source_tier", "history_tokens", "kv_tokens", "timing", "recall")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    REUSED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFILLED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PRUNED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TIME_TO_FIRST_TOKEN_S_FIELD_NUMBER: _ClassVar[int]
    SOURCE_TIER_FIELD_NUMBER: _ClassVar[int]
    HISTORY_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TIMING_FIELD_NUMBER: _ClassVar[int]
    RECALL_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    reused_tokens: int
    prefilled_tokens: int
    pruned_tokens: int
    generated_tokens: int
    time_to_first_token_s: float
    source_tier: Tier
    history_tokens: int
    kv_tokens: int
    timing: TurnTiming
    recall: RecallTraffic
    def __init__(self, prompt_tokens: _Optional[int] = ..., reused_tokens: _Optional[int] = ..., prefilled_tokens: _Optional[int] = ..., pruned_tokens: _Optional[int] = ..., generated_tokens: _Optional[int] = ..., time_to_first_token_s: _Optional[float] = ..., source_tier: _Optional[_Union[Tier, str]] = ..., history_tokens: _Optional[int] = ..., kv_tokens: _Optional[int] = ..., timing: _Optional[_Union[TurnTiming, _Mapping]] = ..., recall: _Optional[_Union[RecallTraffic, _Mapping]] = ...) -> None: ...

class RecallTraffic(_message.Message):
    __slots__ = ("d2h_bytes", "h2d_bytes", "pages_fetched", "recalled_tokens", "recalls")
    D2H_BYTES_FIELD_NUMBER: _ClassVar[int]
    H2D_BYTES_FIELD_NUMBER: _ClassVar[int]
    PAGES_FETCHED_FIELD_NUMBER: _ClassVar[int]
    RECALLED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RECALLS_FIELD_NUMBER: _ClassVar[int]
    d2h_bytes: int
    h2d_bytes: int
    pages_fetched: int
    recalled_tokens: int
    recalls: int
    def __init__(self, d2h_bytes: _Optional[int] = ..., h2d_bytes: _Optional[int] = ..., pages_fetched: _Optional[int] = ..., recalled_tokens: _Optional[int] = ..., recalls: _Optional[int] = ...) -> None: ...

class TurnTiming(_message.Message):
    __slots__ = ("waiting_s", "swap_in_s", "recompute_s", "prefill_s", "decode_s", "decode_stall_s", "other_s", "total_s", "recompute_tokens")
    WAITING_S_FIELD_NUMBER: _ClassVar[int]
    SWAP_IN_S_FIELD_NUMBER: _ClassVar[int]
    RECOMPUTE_S_FIELD_NUMBER: _ClassVar[int]
    PREFILL_S_FIELD_NUMBER: _ClassVar[int]
    DECODE_S_FIELD_NUMBER: _ClassVar[int]
    DECODE_STALL_S_FIELD_NUMBER: _ClassVar[int]
    OTHER_S_FIELD_NUMBER: _ClassVar[int]
    TOTAL_S_FIELD_NUMBER: _ClassVar[int]
    RECOMPUTE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    waiting_s: float
    swap_in_s: float
    recompute_s: float
    prefill_s: float
    decode_s: float
    decode_stall_s: float
    other_s: float
    total_s: float
    recompute_tokens: int
    def __init__(self, waiting_s: _Optional[float] = ..., swap_in_s: _Optional[float] = ..., recompute_s: _Optional[float] = ..., prefill_s: _Optional[float] = ..., decode_s: _Optional[float] = ..., decode_stall_s: _Optional[float] = ..., other_s: _Optional[float] = ..., total_s: _Optional[float] = ..., recompute_tokens: _Optional[int] = ...) -> None: ...

class TurnCompletion(_message.Message):
    __slots__ = ("session_id", "request_id", "turn_index", "generation", "finish_reason", "text", "tool_calls", "token_ids", "usage", "replayed")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TURN_INDEX_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    REPLAYED_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    request_id: str
    turn_index: int
    generation: int
    finish_reason: FinishReason
    text: str
    tool_calls: _containers.RepeatedCompositeFieldContainer[ToolCall]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    usage: Usage
    replayed: bool
    def __init__(self, session_id: _Optional[str] = ..., request_id: _Optional[str] = ..., turn_index: _Optional[int] = ..., generation: _Optional[int] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., text: _Optional[str] = ..., tool_calls: _Optional[_Iterable[_Union[ToolCall, _Mapping]]] = ..., token_ids: _Optional[_Iterable[int]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., replayed: _Optional[bool] = ...) -> None: ...

class PruneRecord(_message.Message):
    __slots__ = ("turn", "start", "end", "prune_policy", "prune_keep_ratio", "prune_scope", "reason", "removed")
    TURN_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    PRUNE_POLICY_FIELD_NUMBER: _ClassVar[int]
    PRUNE_KEEP_RATIO_FIELD_NUMBER: _ClassVar[int]
    PRUNE_SCOPE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    turn: int
    start: int
    end: int
    prune_policy: str
    prune_keep_ratio: float
    prune_scope: str
    reason: str
    removed: int
    def __init__(self, turn: _Optional[int] = ..., start: _Optional[int] = ..., end: _Optional[int] = ..., prune_policy: _Optional[str] = ..., prune_keep_ratio: _Optional[float] = ..., prune_scope: _Optional[str] = ..., reason: _Optional[str] = ..., removed: _Optional[int] = ...) -> None: ...

class Session(_message.Message):
    __slots__ = ("session_id", "state", "turn_index", "generation", "history_tokens", "digest", "method", "budget", "budget_ratio", "method_args", "kv_tokens", "kv_pages", "pruned_kv_tokens", "shared_prefix_tokens", "prune_log", "source_tier", "snapshot_state", "committed_generation", "snapshot_error")
    class MethodArgsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    TURN_INDEX_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    HISTORY_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    METHOD_FIELD_NUMBER: _ClassVar[int]
    BUDGET_FIELD_NUMBER: _ClassVar[int]
    BUDGET_RATIO_FIELD_NUMBER: _ClassVar[int]
    METHOD_ARGS_FIELD_NUMBER: _ClassVar[int]
    KV_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_PAGES_FIELD_NUMBER: _ClassVar[int]
    PRUNED_KV_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SHARED_PREFIX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PRUNE_LOG_FIELD_NUMBER: _ClassVar[int]
    SOURCE_TIER_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_STATE_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_GENERATION_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_ERROR_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    state: SessionState
    turn_index: int
    generation: int
    history_tokens: int
    digest: str
    method: str
    budget: int
    budget_ratio: float
    method_args: _containers.ScalarMap[str, str]
    kv_tokens: int
    kv_pages: int
    pruned_kv_tokens: int
    shared_prefix_tokens: int
    prune_log: _containers.RepeatedCompositeFieldContainer[PruneRecord]
    source_tier: Tier
    snapshot_state: SnapshotState
    committed_generation: int
    snapshot_error: str
    def __init__(self, session_id: _Optional[str] = ..., state: _Optional[_Union[SessionState, str]] = ..., turn_index: _Optional[int] = ..., generation: _Optional[int] = ..., history_tokens: _Optional[int] = ..., digest: _Optional[str] = ..., method: _Optional[str] = ..., budget: _Optional[int] = ..., budget_ratio: _Optional[float] = ..., method_args: _Optional[_Mapping[str, str]] = ..., kv_tokens: _Optional[int] = ..., kv_pages: _Optional[int] = ..., pruned_kv_tokens: _Optional[int] = ..., shared_prefix_tokens: _Optional[int] = ..., prune_log: _Optional[_Iterable[_Union[PruneRecord, _Mapping]]] = ..., source_tier: _Optional[_Union[Tier, str]] = ..., snapshot_state: _Optional[_Union[SnapshotState, str]] = ..., committed_generation: _Optional[int] = ..., snapshot_error: _Optional[str] = ...) -> None: ...

class ResumeRequest(_message.Message):
    __slots__ = ("session_id", "expected_turn_index")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_TURN_INDEX_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    expected_turn_index: int
    def __init__(self, session_id: _Optional[str] = ..., expected_turn_index: _Optional[int] = ...) -> None: ...

class EndSessionRequest(_message.Message):
    __slots__ = ("session_id", "keep_snapshot")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    KEEP_SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    keep_snapshot: bool
    def __init__(self, session_id: _Optional[str] = ..., keep_snapshot: _Optional[bool] = ...) -> None: ...

class EndSessionResponse(_message.Message):
    __slots__ = ("ended_here", "deleted_from_store")
    ENDED_HERE_FIELD_NUMBER: _ClassVar[int]
    DELETED_FROM_STORE_FIELD_NUMBER: _ClassVar[int]
    ended_here: bool
    deleted_from_store: bool
    def __init__(self, ended_here: _Optional[bool] = ..., deleted_from_store: _Optional[bool] = ...) -> None: ...

class GetSessionRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class ForkSessionRequest(_message.Message):
    __slots__ = ("session_id", "new_session_id")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    NEW_SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    new_session_id: str
    def __init__(self, session_id: _Optional[str] = ..., new_session_id: _Optional[str] = ...) -> None: ...

class PruneHistoryRequest(_message.Message):
    __slots__ = ("session_id", "start", "end", "prune_roles", "prune_lag", "prune_policy", "prune_keep_ratio", "prune_scope")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    PRUNE_ROLES_FIELD_NUMBER: _ClassVar[int]
    PRUNE_LAG_FIELD_NUMBER: _ClassVar[int]
    PRUNE_POLICY_FIELD_NUMBER: _ClassVar[int]
    PRUNE_KEEP_RATIO_FIELD_NUMBER: _ClassVar[int]
    PRUNE_SCOPE_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    start: int
    end: int
    prune_roles: _containers.RepeatedScalarFieldContainer[str]
    prune_lag: int
    prune_policy: str
    prune_keep_ratio: float
    prune_scope: str
    def __init__(self, session_id: _Optional[str] = ..., start: _Optional[int] = ..., end: _Optional[int] = ..., prune_roles: _Optional[_Iterable[str]] = ..., prune_lag: _Optional[int] = ..., prune_policy: _Optional[str] = ..., prune_keep_ratio: _Optional[float] = ..., prune_scope: _Optional[str] = ...) -> None: ...

class PruneHistoryResponse(_message.Message):
    __slots__ = ("removed", "pruned_tokens", "session")
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    PRUNED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    removed: int
    pruned_tokens: int
    session: Session
    def __init__(self, removed: _Optional[int] = ..., pruned_tokens: _Optional[int] = ..., session: _Optional[_Union[Session, _Mapping]] = ...) -> None: ...

class GetServerInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ServerInfo(_message.Message):
    __slots__ = ("model", "architecture", "max_model_len", "default_max_tokens", "method", "methods", "vocab_size")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    ARCHITECTURE_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    METHOD_FIELD_NUMBER: _ClassVar[int]
    METHODS_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    model: str
    architecture: str
    max_model_len: int
    default_max_tokens: int
    method: str
    methods: _containers.RepeatedScalarFieldContainer[str]
    vocab_size: int
    def __init__(self, model: _Optional[str] = ..., architecture: _Optional[str] = ..., max_model_len: _Optional[int] = ..., default_max_tokens: _Optional[int] = ..., method: _Optional[str] = ..., methods: _Optional[_Iterable[str]] = ..., vocab_size: _Optional[int] = ...) -> None: ...
