from tide.proto.tide.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ForgetDataRequest(_message.Message):
    __slots__ = ("request_id", "key_id")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    KEY_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    key_id: str
    def __init__(self, request_id: _Optional[str] = ..., key_id: _Optional[str] = ...) -> None: ...

class ForgetDataResponse(_message.Message):
    __slots__ = ("chunks_deleted", "chunks_rewritten", "rows_removed", "requests_removed", "stream_entries_deleted", "memory_notice")
    CHUNKS_DELETED_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_REWRITTEN_FIELD_NUMBER: _ClassVar[int]
    ROWS_REMOVED_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_REMOVED_FIELD_NUMBER: _ClassVar[int]
    STREAM_ENTRIES_DELETED_FIELD_NUMBER: _ClassVar[int]
    MEMORY_NOTICE_FIELD_NUMBER: _ClassVar[int]
    chunks_deleted: _containers.RepeatedScalarFieldContainer[str]
    chunks_rewritten: _containers.RepeatedScalarFieldContainer[str]
    rows_removed: int
    requests_removed: _containers.RepeatedScalarFieldContainer[str]
    stream_entries_deleted: int
    memory_notice: bool
    def __init__(self, chunks_deleted: _Optional[_Iterable[str]] = ..., chunks_rewritten: _Optional[_Iterable[str]] = ..., rows_removed: _Optional[int] = ..., requests_removed: _Optional[_Iterable[str]] = ..., stream_entries_deleted: _Optional[int] = ..., memory_notice: _Optional[bool] = ...) -> None: ...

class SweepDataRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SweepDataResponse(_message.Message):
    __slots__ = ("chunks_deleted", "bucket_chunk_bytes", "bucket_chunks")
    class ChunksDeletedEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    CHUNKS_DELETED_FIELD_NUMBER: _ClassVar[int]
    BUCKET_CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    BUCKET_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    chunks_deleted: _containers.ScalarMap[str, int]
    bucket_chunk_bytes: int
    bucket_chunks: int
    def __init__(self, chunks_deleted: _Optional[_Mapping[str, int]] = ..., bucket_chunk_bytes: _Optional[int] = ..., bucket_chunks: _Optional[int] = ...) -> None: ...

class TriggerTrainingRequest(_message.Message):
    __slots__ = ("target_model", "reason", "force")
    TARGET_MODEL_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    FORCE_FIELD_NUMBER: _ClassVar[int]
    target_model: str
    reason: str
    force: bool
    def __init__(self, target_model: _Optional[str] = ..., reason: _Optional[str] = ..., force: _Optional[bool] = ...) -> None: ...

class TriggerTrainingResponse(_message.Message):
    __slots__ = ("accepted", "run_id", "detail")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    accepted: bool
    run_id: str
    detail: str
    def __init__(self, accepted: _Optional[bool] = ..., run_id: _Optional[str] = ..., detail: _Optional[str] = ...) -> None: ...

class TrainingOutcome(_message.Message):
    __slots__ = ("run_id", "target_model", "candidate_version", "base_version", "eval_accept_length_candidate", "eval_accept_length_base", "promoted", "detail", "train_tokens", "eval_tokens", "duration_s", "finished_unix_s")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    TARGET_MODEL_FIELD_NUMBER: _ClassVar[int]
    CANDIDATE_VERSION_FIELD_NUMBER: _ClassVar[int]
    BASE_VERSION_FIELD_NUMBER: _ClassVar[int]
    EVAL_ACCEPT_LENGTH_CANDIDATE_FIELD_NUMBER: _ClassVar[int]
    EVAL_ACCEPT_LENGTH_BASE_FIELD_NUMBER: _ClassVar[int]
    PROMOTED_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    TRAIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    EVAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DURATION_S_FIELD_NUMBER: _ClassVar[int]
    FINISHED_UNIX_S_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    target_model: str
    candidate_version: str
    base_version: str
    eval_accept_length_candidate: float
    eval_accept_length_base: float
    promoted: bool
    detail: str
    train_tokens: int
    eval_tokens: int
    duration_s: float
    finished_unix_s: float
    def __init__(self, run_id: _Optional[str] = ..., target_model: _Optional[str] = ..., candidate_version: _Optional[str] = ..., base_version: _Optional[str] = ..., eval_accept_length_candidate: _Optional[float] = ..., eval_accept_length_base: _Optional[float] = ..., promoted: _Optional[bool] = ..., detail: _Optional[str] = ..., train_tokens: _Optional[int] = ..., eval_tokens: _Optional[int] = ..., duration_s: _Optional[float] = ..., finished_unix_s: _Optional[float] = ...) -> None: ...

class GetTrainerStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TrainerStatus(_message.Message):
    __slots__ = ("state", "run_id", "target_model", "buffered_chunks", "buffered_tokens", "chunks_consumed", "chunks_deduplicated", "chunks_dead_lettered", "last_outcome", "progress", "loss", "chunks_deleted", "chunk_bytes_deleted", "chunks_quarantined", "bucket_chunk_bytes", "bucket_budget_bytes", "stream_entries_trimmed")
    class State(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        STATE_UNSPECIFIED: _ClassVar[TrainerStatus.State]
        STATE_IDLE: _ClassVar[TrainerStatus.State]
        STATE_TRAINING: _ClassVar[TrainerStatus.State]
        STATE_EVALUATING: _ClassVar[TrainerStatus.State]
    STATE_UNSPECIFIED: TrainerStatus.State
    STATE_IDLE: TrainerStatus.State
    STATE_TRAINING: TrainerStatus.State
    STATE_EVALUATING: TrainerStatus.State
    class ChunksDeletedEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    STATE_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    TARGET_MODEL_FIELD_NUMBER: _ClassVar[int]
    BUFFERED_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    BUFFERED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_CONSUMED_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_DEDUPLICATED_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_DEAD_LETTERED_FIELD_NUMBER: _ClassVar[int]
    LAST_OUTCOME_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_DELETED_FIELD_NUMBER: _ClassVar[int]
    CHUNK_BYTES_DELETED_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_QUARANTINED_FIELD_NUMBER: _ClassVar[int]
    BUCKET_CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    BUCKET_BUDGET_BYTES_FIELD_NUMBER: _ClassVar[int]
    STREAM_ENTRIES_TRIMMED_FIELD_NUMBER: _ClassVar[int]
    state: TrainerStatus.State
    run_id: str
    target_model: str
    buffered_chunks: int
    buffered_tokens: int
    chunks_consumed: int
    chunks_deduplicated: int
    chunks_dead_lettered: int
    last_outcome: TrainingOutcome
    progress: float
    loss: float
    chunks_deleted: _containers.ScalarMap[str, int]
    chunk_bytes_deleted: int
    chunks_quarantined: int
    bucket_chunk_bytes: int
    bucket_budget_bytes: int
    stream_entries_trimmed: int
    def __init__(self, state: _Optional[_Union[TrainerStatus.State, str]] = ..., run_id: _Optional[str] = ..., target_model: _Optional[str] = ..., buffered_chunks: _Optional[int] = ..., buffered_tokens: _Optional[int] = ..., chunks_consumed: _Optional[int] = ..., chunks_deduplicated: _Optional[int] = ..., chunks_dead_lettered: _Optional[int] = ..., last_outcome: _Optional[_Union[TrainingOutcome, _Mapping]] = ..., progress: _Optional[float] = ..., loss: _Optional[float] = ..., chunks_deleted: _Optional[_Mapping[str, int]] = ..., chunk_bytes_deleted: _Optional[int] = ..., chunks_quarantined: _Optional[int] = ..., bucket_chunk_bytes: _Optional[int] = ..., bucket_budget_bytes: _Optional[int] = ..., stream_entries_trimmed: _Optional[int] = ...) -> None: ...
