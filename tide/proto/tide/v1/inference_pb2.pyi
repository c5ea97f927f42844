from tide.proto.tide.v1 import common_pb2 as _common_pb2
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
    FINISH_REASON_CANCELLED: _ClassVar[FinishReason]
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_CANCELLED: FinishReason

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids", "ignore_eos", "logprobs", "prompt_logprobs", "logit_bias", "presence_penalty", "frequency_penalty", "json_object", "json_schema", "regex", "grammar", "min_tokens", "repetition_penalty", "min_p")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    JSON_OBJECT_FIELD_NUMBER: _ClassVar[int]
    JSON_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    REGEX_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    logprobs: int
    prompt_logprobs: int
    logit_bias: _containers.ScalarMap[int, float]
    presence_penalty: float
    frequency_penalty: float
    json_object: bool
    json_schema: str
    regex: str
    grammar: str
    min_tokens: int
    repetition_penalty: float
    min_p: float
    def __init__(self, max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., logprobs: _Optional[int] = ..., prompt_logprobs: _Optional[int] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., json_object: _Optional[bool] = ..., json_schema: _Optional[str] = ..., regex: _Optional[str] = ..., grammar: _Optional[str] = ..., min_tokens: _Optional[int] = ..., repetition_penalty: _Optional[float] = ..., min_p: _Optional[float] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "prompt_text", "sampling", "speculative", "workload", "no_capture", "key_id", "no_memory")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TEXT_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    SPECULATIVE_FIELD_NUMBER: _ClassVar[int]
    WORKLOAD_FIELD_NUMBER: _ClassVar[int]
    NO_CAPTURE_FIELD_NUMBER: _ClassVar[int]
    KEY_ID_FIELD_NUMBER: _ClassVar[int]
    NO_MEMORY_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: TokenIds
    prompt_text: str
    sampling: SamplingParams
    speculative: bool
    workload: str
    no_capture: bool
    key_id: str
    no_memory: bool
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., prompt_text: _Optional[str] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., speculative: _Optional[bool] = ..., workload: _Optional[str] = ..., no_capture: _Optional[bool] = ..., key_id: _Optional[str] = ..., no_memory: _Optional[bool] = ...) -> None: ...

class TokenChunk(_message.Message):
    __slots__ = ("token_ids", "text", "logprobs", "prompt_logprobs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "logprob", "top")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    top: _containers.RepeatedCompositeFieldContainer[TopLogprob]
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., top: _Optional[_Iterable[_Union[TopLogprob, _Mapping]]] = ...) -> None: ...

class TopLogprob(_message.Message):
    __slots__ = ("token_id", "logprob")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ...) -> None: ...

class SpeculationStats(_message.Message):
    __slots__ = ("accept_length", "draft_tokens", "accepted_tokens", "verify_steps", "plain_steps", "draft_version", "drafter")
    ACCEPT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    VERIFY_STEPS_FIELD_NUMBER: _ClassVar[int]
    PLAIN_STEPS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_VERSION_FIELD_NUMBER: _ClassVar[int]
    DRAFTER_FIELD_NUMBER: _ClassVar[int]
    accept_length: float
    draft_tokens: int
    accepted_tokens: int
    verify_steps: int
    plain_steps: int
    draft_version: str
    drafter: str
    def __init__(self, accept_length: _Optional[float] = ..., draft_tokens: _Optional[int] = ..., accepted_tokens: _Optional[int] = ..., verify_steps: _Optional[int] = ..., plain_steps: _Optional[int] = ..., draft_version: _Optional[str] = ..., drafter: _Optional[str] = ...) -> None: ...

class GenerateFinal(_message.Message):
    __slots__ = ("finish_reason", "stop_string", "stop_token_id", "prompt_tokens", "completion_tokens", "speculation", "time_to_first_token_ms", "total_ms", "cached_prompt_tokens")
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STOP_STRING_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SPECULATION_FIELD_NUMBER: _ClassVar[int]
    TIME_TO_FIRST_TOKEN_MS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_MS_FIELD_NUMBER: _ClassVar[int]
    CACHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    finish_reason: FinishReason
    stop_string: str
    stop_token_id: int
    prompt_tokens: int
    completion_tokens: int
    speculation: SpeculationStats
    time_to_first_token_ms: float
    total_ms: float
    cached_prompt_tokens: int
    def __init__(self, finish_reason: _Optional[_Union[FinishReason, str]] = ..., stop_string: _Optional[str] = ..., stop_token_id: _Optional[int] = ..., prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., speculation: _Optional[_Union[SpeculationStats, _Mapping]] = ..., time_to_first_token_ms: _Optional[float] = ..., total_ms: _Optional[float] = ..., cached_prompt_tokens: _Optional[int] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "chunk", "final", "error")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    FINAL_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    chunk: TokenChunk
    final: GenerateFinal
    error: _common_pb2.Error
    def __init__(self, request_id: _Optional[str] = ..., chunk: _Optional[_Union[TokenChunk, _Mapping]] = ..., final: _Optional[_Union[GenerateFinal, _Mapping]] = ..., error: _Optional[_Union[_common_pb2.Error, _Mapping]] = ...) -> None: ...

class CancelRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class CancelResponse(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: bool
    def __init__(self, found: _Optional[bool] = ...) -> None: ...

class GetWorkerStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerStatus(_message.Message):
    __slots__ = ("worker_id", "model_id", "engine", "device", "running_requests", "waiting_requests", "max_batch_size", "load", "kv_cache_usage", "draft_version", "drafter", "gamma_policy", "speculation", "collection_enabled", "last_decision_id", "uptime_s", "max_model_len", "registry_draft_version", "wanted_draft_version", "draft_refusals", "live", "memory")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    RUNNING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    WAITING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_USAGE_FIELD_NUMBER: _ClassVar[int]
    DRAFT_VERSION_FIELD_NUMBER: _ClassVar[int]
    DRAFTER_FIELD_NUMBER: _ClassVar[int]
    GAMMA_POLICY_FIELD_NUMBER: _ClassVar[int]
    SPECULATION_FIELD_NUMBER: _ClassVar[int]
    COLLECTION_ENABLED_FIELD_NUMBER: _ClassVar[int]
    LAST_DECISION_ID_FIELD_NUMBER: _ClassVar[int]
    UPTIME_S_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    REGISTRY_DRAFT_VERSION_FIELD_NUMBER: _ClassVar[int]
    WANTED_DRAFT_VERSION_FIELD_NUMBER: _ClassVar[int]
    DRAFT_REFUSALS_FIELD_NUMBER: _ClassVar[int]
    LIVE_FIELD_NUMBER: _ClassVar[int]
    MEMORY_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    model_id: str
    engine: str
    device: str
    running_requests: int
    waiting_requests: int
    max_batch_size: int
    load: float
    kv_cache_usage: float
    draft_version: str
    drafter: str
    gamma_policy: GammaPolicy
    speculation: SpeculationSchedule
    collection_enabled: bool
    last_decision_id: str
    uptime_s: float
    max_model_len: int
    registry_draft_version: str
    wanted_draft_version: str
    draft_refusals: _containers.RepeatedCompositeFieldContainer[DraftRefusal]
    live: WorkerLive
    memory: WorkerMemory
    def __init__(self, worker_id: _Optional[str] = ..., model_id: _Optional[str] = ..., engine: _Optional[str] = ..., device: _Optional[str] = ..., running_requests: _Optional[int] = ..., waiting_requests: _Optional[int] = ..., max_batch_size: _Optional[int] = ..., load: _Optional[float] = ..., kv_cache_usage: _Optional[float] = ..., draft_version: _Optional[str] = ..., drafter: _Optional[str] = ..., gamma_policy: _Optional[_Union[GammaPolicy, _Mapping]] = ..., speculation: _Optional[_Union[SpeculationSchedule, _Mapping]] = ..., collection_enabled: _Optional[bool] = ..., last_decision_id: _Optional[str] = ..., uptime_s: _Optional[float] = ..., max_model_len: _Optional[int] = ..., registry_draft_version: _Optional[str] = ..., wanted_draft_version: _Optional[str] = ..., draft_refusals: _Optional[_Iterable[_Union[DraftRefusal, _Mapping]]] = ..., live: _Optional[_Union[WorkerLive, _Mapping]] = ..., memory: _Optional[_Union[WorkerMemory, _Mapping]] = ...) -> None: ...

class WorkerMemory(_message.Message):
    __slots__ = ("rss_bytes", "weights_bytes", "kv_cache_bytes", "draft_bytes", "speculation_memory_bytes", "speculation_memory_budget_bytes", "speculation_memory_tokens", "kv_cache_resident_bytes")
    RSS_BYTES_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_BYTES_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_BYTES_FIELD_NUMBER: _ClassVar[int]
    DRAFT_BYTES_FIELD_NUMBER: _ClassVar[int]
    SPECULATION_MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    SPECULATION_MEMORY_BUDGET_BYTES_FIELD_NUMBER: _ClassVar[int]
    SPECULATION_MEMORY_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_RESIDENT_BYTES_FIELD_NUMBER: _ClassVar[int]
    rss_bytes: int
    weights_bytes: int
    kv_cache_bytes: int
    draft_bytes: int
    speculation_memory_bytes: int
    speculation_memory_budget_bytes: int
    speculation_memory_tokens: int
    kv_cache_resident_bytes: int
    def __init__(self, rss_bytes: _Optional[int] = ..., weights_bytes: _Optional[int] = ..., kv_cache_bytes: _Optional[int] = ..., draft_bytes: _Optional[int] = ..., speculation_memory_bytes: _Optional[int] = ..., speculation_memory_budget_bytes: _Optional[int] = ..., speculation_memory_tokens: _Optional[int] = ..., kv_cache_resident_bytes: _Optional[int] = ...) -> None: ...

class WorkerLive(_message.Message):
    __slots__ = ("tokens_per_s", "window_s", "tokens_total", "steps_total", "drafts", "gamma")
    TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    WINDOW_S_FIELD_NUMBER: _ClassVar[int]
    TOKENS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    STEPS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    DRAFTS_FIELD_NUMBER: _ClassVar[int]
    GAMMA_FIELD_NUMBER: _ClassVar[int]
    tokens_per_s: float
    window_s: float
    tokens_total: int
    steps_total: int
    drafts: _containers.RepeatedCompositeFieldContainer[DraftAcceptance]
    gamma: _containers.RepeatedCompositeFieldContainer[GammaBucket]
    def __init__(self, tokens_per_s: _Optional[float] = ..., window_s: _Optional[float] = ..., tokens_total: _Optional[int] = ..., steps_total: _Optional[int] = ..., drafts: _Optional[_Iterable[_Union[DraftAcceptance, _Mapping]]] = ..., gamma: _Optional[_Iterable[_Union[GammaBucket, _Mapping]]] = ...) -> None: ...

class DraftAcceptance(_message.Message):
    __slots__ = ("draft_version", "drafter", "verify_rows", "draft_tokens", "accepted_tokens", "last_unix_s")
    DRAFT_VERSION_FIELD_NUMBER: _ClassVar[int]
    DRAFTER_FIELD_NUMBER: _ClassVar[int]
    VERIFY_ROWS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LAST_UNIX_S_FIELD_NUMBER: _ClassVar[int]
    draft_version: str
    drafter: str
    verify_rows: int
    draft_tokens: int
    accepted_tokens: int
    last_unix_s: float
    def __init__(self, draft_version: _Optional[str] = ..., drafter: _Optional[str] = ..., verify_rows: _Optional[int] = ..., draft_tokens: _Optional[int] = ..., accepted_tokens: _Optional[int] = ..., last_unix_s: _Optional[float] = ...) -> None: ...

class GammaBucket(_message.Message):
    __slots__ = ("min_batch", "max_batch", "steps", "speculative_steps", "gamma_sum", "speculative_rows", "last_gamma")
    MIN_BATCH_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    SPECULATIVE_STEPS_FIELD_NUMBER: _ClassVar[int]
    GAMMA_SUM_FIELD_NUMBER: _ClassVar[int]
    SPECULATIVE_ROWS_FIELD_NUMBER: _ClassVar[int]
    LAST_GAMMA_FIELD_NUMBER: _ClassVar[int]
    min_batch: int
    max_batch: int
    steps: int
    speculative_steps: int
    gamma_sum: int
    speculative_rows: int
    last_gamma: int
    def __init__(self, min_batch: _Optional[int] = ..., max_batch: _Optional[int] = ..., steps: _Optional[int] = ..., speculative_steps: _Optional[int] = ..., gamma_sum: _Optional[int] = ..., speculative_rows: _Optional[int] = ..., last_gamma: _Optional[int] = ...) -> None: ...

class DraftRefusal(_message.Message):
    __slots__ = ("version", "reason", "detail", "time_unix_s")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    TIME_UNIX_S_FIELD_NUMBER: _ClassVar[int]
    version: str
    reason: str
    detail: str
    time_unix_s: float
    def __init__(self, version: _Optional[str] = ..., reason: _Optional[str] = ..., detail: _Optional[str] = ..., time_unix_s: _Optional[float] = ...) -> None: ...

class SpeculationBucket(_message.Message):
    __slots__ = ("min_batch", "max_batch", "enabled")
    MIN_BATCH_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_FIELD_NUMBER: _ClassVar[int]
    ENABLED_FIELD_NUMBER: _ClassVar[int]
    min_batch: int
    max_batch: int
    enabled: bool
    def __init__(self, min_batch: _Optional[int] = ..., max_batch: _Optional[int] = ..., enabled: _Optional[bool] = ...) -> None: ...

class SpeculationSchedule(_message.Message):
    __slots__ = ("buckets",)
    BUCKETS_FIELD_NUMBER: _ClassVar[int]
    buckets: _containers.RepeatedCompositeFieldContainer[SpeculationBucket]
    def __init__(self, buckets: _Optional[_Iterable[_Union[SpeculationBucket, _Mapping]]] = ...) -> None: ...

class GammaPolicy(_message.Message):
    __slots__ = ("name", "params", "table_json")
    class ParamsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    NAME_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    TABLE_JSON_FIELD_NUMBER: _ClassVar[int]
    name: str
    params: _containers.ScalarMap[str, float]
    table_json: str
    def __init__(self, name: _Optional[str] = ..., params: _Optional[_Mapping[str, float]] = ..., table_json: _Optional[str] = ...) -> None: ...

class Decision(_message.Message):
    __slots__ = ("decision_id", "target_model", "speculation", "gamma_policy", "collection_enabled", "drafter", "reason", "issued_unix_s")
    DECISION_ID_FIELD_NUMBER: _ClassVar[int]
    TARGET_MODEL_FIELD_NUMBER: _ClassVar[int]
    SPECULATION_FIELD_NUMBER: _ClassVar[int]
    GAMMA_POLICY_FIELD_NUMBER: _ClassVar[int]
    COLLECTION_ENABLED_FIELD_NUMBER: _ClassVar[int]
    DRAFTER_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    ISSUED_UNIX_S_FIELD_NUMBER: _ClassVar[int]
    decision_id: str
    target_model: str
    speculation: SpeculationSchedule
    gamma_policy: GammaPolicy
    collection_enabled: bool
    drafter: str
    reason: str
    issued_unix_s: float
    def __init__(self, decision_id: _Optional[str] = ..., target_model: _Optional[str] = ..., speculation: _Optional[_Union[SpeculationSchedule, _Mapping]] = ..., gamma_policy: _Optional[_Union[GammaPolicy, _Mapping]] = ..., collection_enabled: _Optional[bool] = ..., drafter: _Optional[str] = ..., reason: _Optional[str] = ..., issued_unix_s: _Optional[float] = ...) -> None: ...

class ApplyDecisionResponse(_message.Message):
    __slots__ = ("outcome", "detail", "status")
    class Outcome(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        OUTCOME_UNSPECIFIED: _ClassVar[ApplyDecisionResponse.Outcome]
        OUTCOME_APPLIED: _ClassVar[ApplyDecisionResponse.Outcome]
        OUTCOME_ALREADY_APPLIED: _ClassVar[ApplyDecisionResponse.Outcome]
        OUTCOME_REJECTED: _ClassVar[ApplyDecisionResponse.Outcome]
    OUTCOME_UNSPECIFIED: ApplyDecisionResponse.Outcome
    OUTCOME_APPLIED: ApplyDecisionResponse.Outcome
    OUTCOME_ALREADY_APPLIED: ApplyDecisionResponse.Outcome
    OUTCOME_REJECTED: ApplyDecisionResponse.Outcome
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    outcome: ApplyDecisionResponse.Outcome
    detail: str
    status: WorkerStatus
    def __init__(self, outcome: _Optional[_Union[ApplyDecisionResponse.Outcome, str]] = ..., detail: _Optional[str] = ..., status: _Optional[_Union[WorkerStatus, _Mapping]] = ...) -> None: ...
