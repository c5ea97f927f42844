from tide.proto.tide.v1 import common_pb2 as _common_pb2
from tide.proto.tide.v1 import inference_pb2 as _inference_pb2
from tide.proto.tide.v1 import trainer_pb2 as _trainer_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GetControllerStateRequest(_message.Message):
    __slots__ = ("target_model", "max_decisions")
    TARGET_MODEL_FIELD_NUMBER: _ClassVar[int]
    MAX_DECISIONS_FIELD_NUMBER: _ClassVar[int]
    target_model: str
    max_decisions: int
    def __init__(self, target_model: _Optional[str] = ..., max_decisions: _Optional[int] = ...) -> None: ...

class DraftStats(_message.Message):
    __slots__ = ("draft_version", "accept_length_ema_short", "accept_length_ema_long", "verify_steps", "tokens", "last_update_unix_s", "acceptance_rate_ema_short", "acceptance_rate_ema_long")
    DRAFT_VERSION_FIELD_NUMBER: _ClassVar[int]
    ACCEPT_LENGTH_EMA_SHORT_FIELD_NUMBER: _ClassVar[int]
    ACCEPT_LENGTH_EMA_LONG_FIELD_NUMBER: _ClassVar[int]
    VERIFY_STEPS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    LAST_UPDATE_UNIX_S_FIELD_NUMBER: _ClassVar[int]
    ACCEPTANCE_RATE_EMA_SHORT_FIELD_NUMBER: _ClassVar[int]
    ACCEPTANCE_RATE_EMA_LONG_FIELD_NUMBER: _ClassVar[int]
    draft_version: str
    accept_length_ema_short: float
    accept_length_ema_long: float
    verify_steps: int
    tokens: int
    last_update_unix_s: float
    acceptance_rate_ema_short: float
    acceptance_rate_ema_long: float
    def __init__(self, draft_version: _Optional[str] = ..., accept_length_ema_short: _Optional[float] = ..., accept_length_ema_long: _Optional[float] = ..., verify_steps: _Optional[int] = ..., tokens: _Optional[int] = ..., last_update_unix_s: _Optional[float] = ..., acceptance_rate_ema_short: _Optional[float] = ..., acceptance_rate_ema_long: _Optional[float] = ...) -> None: ...

class CollectionState(_message.Message):
    __slots__ = ("enabled", "reason", "tokens_collected", "tokens_needed", "since_unix_s")
    ENABLED_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    TOKENS_COLLECTED_FIELD_NUMBER: _ClassVar[int]
    TOKENS_NEEDED_FIELD_NUMBER: _ClassVar[int]
    SINCE_UNIX_S_FIELD_NUMBER: _ClassVar[int]
    enabled: bool
    reason: str
    tokens_collected: int
    tokens_needed: int
    since_unix_s: float
    def __init__(self, enabled: _Optional[bool] = ..., reason: _Optional[str] = ..., tokens_collected: _Optional[int] = ..., tokens_needed: _Optional[int] = ..., since_unix_s: _Optional[float] = ...) -> None: ...

class RollbackRecord(_message.Message):
    __slots__ = ("from_version", "to_version", "reason", "live_accept_length", "previous_accept_length", "verify_steps", "time_unix_s", "live_acceptance_rate", "previous_acceptance_rate")
    FROM_VERSION_FIELD_NUMBER: _ClassVar[int]
    TO_VERSION_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    LIVE_ACCEPT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    PREVIOUS_ACCEPT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    VERIFY_STEPS_FIELD_NUMBER: _ClassVar[int]
    TIME_UNIX_S_FIELD_NUMBER: _ClassVar[int]
    LIVE_ACCEPTANCE_RATE_FIELD_NUMBER: _ClassVar[int]
    PREVIOUS_ACCEPTANCE_RATE_FIELD_NUMBER: _ClassVar[int]
    from_version: str
    to_version: str
    reason: str
    live_accept_length: float
    previous_accept_length: float
    verify_steps: int
    time_unix_s: float
    live_acceptance_rate: float
    previous_acceptance_rate: float
    def __init__(self, from_version: _Optional[str] = ..., to_version: _Optional[str] = ..., reason: _Optional[str] = ..., live_accept_length: _Optional[float] = ..., previous_accept_length: _Optional[float] = ..., verify_steps: _Optional[int] = ..., time_unix_s: _Optional[float] = ..., live_acceptance_rate: _Optional[float] = ..., previous_acceptance_rate: _Optional[float] = ...) -> None: ...

class RollbackState(_message.Message):
    __slots__ = ("enabled", "watching_version", "previous_version", "verify_steps", "window", "last")
    ENABLED_FIELD_NUMBER: _ClassVar[int]
    WATCHING_VERSION_FIELD_NUMBER: _ClassVar[int]
    PREVIOUS_VERSION_FIELD_NUMBER: _ClassVar[int]
    VERIFY_STEPS_FIELD_NUMBER: _ClassVar[int]
    WINDOW_FIELD_NUMBER: _ClassVar[int]
    LAST_FIELD_NUMBER: _ClassVar[int]
    enabled: bool
    watching_version: str
    previous_version: str
    verify_steps: int
    window: int
    last: RollbackRecord
    def __init__(self, enabled: _Optional[bool] = ..., watching_version: _Optional[str] = ..., previous_version: _Optional[str] = ..., verify_steps: _Optional[int] = ..., window: _Optional[int] = ..., last: _Optional[_Union[RollbackRecord, _Mapping]] = ...) -> None: ...

class TargetState(_message.Message):
    __slots__ = ("target_model", "draft_version", "drafts", "collection", "speculation", "gamma_policy", "last_training", "rollback", "draft_refusals")
    TARGET_MODEL_FIELD_NUMBER: _ClassVar[int]
    DRAFT_VERSION_FIELD_NUMBER: _ClassVar[int]
    DRAFTS_FIELD_NUMBER: _ClassVar[int]
    COLLECTION_FIELD_NUMBER: _ClassVar[int]
    SPECULATION_FIELD_NUMBER: _ClassVar[int]
    GAMMA_POLICY_FIELD_NUMBER: _ClassVar[int]
    LAST_TRAINING_FIELD_NUMBER: _ClassVar[int]
    ROLLBACK_FIELD_NUMBER: _ClassVar[int]
    DRAFT_REFUSALS_FIELD_NUMBER: _ClassVar[int]
    target_model: str
    draft_version: str
    drafts: _containers.RepeatedCompositeFieldContainer[DraftStats]
    collection: CollectionState
    speculation: _inference_pb2.SpeculationSchedule
    gamma_policy: _inference_pb2.GammaPolicy
    last_training: _trainer_pb2.TrainingOutcome
    rollback: RollbackState
    draft_refusals: _containers.RepeatedCompositeFieldContainer[DraftRefusalRecord]
    def __init__(self, target_model: _Optional[str] = ..., draft_version: _Optional[str] = ..., drafts: _Optional[_Iterable[_Union[DraftStats, _Mapping]]] = ..., collection: _Optional[_Union[CollectionState, _Mapping]] = ..., speculation: _Optional[_Union[_inference_pb2.SpeculationSchedule, _Mapping]] = ..., gamma_policy: _Optional[_Union[_inference_pb2.GammaPolicy, _Mapping]] = ..., last_training: _Optional[_Union[_trainer_pb2.TrainingOutcome, _Mapping]] = ..., rollback: _Optional[_Union[RollbackState, _Mapping]] = ..., draft_refusals: _Optional[_Iterable[_Union[DraftRefusalRecord, _Mapping]]] = ...) -> None: ...

class DraftRefusalRecord(_message.Message):
    __slots__ = ("worker_id", "version", "reason", "detail", "refused_unix_s", "outcome", "to_version", "note", "time_unix_s")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    REFUSED_UNIX_S_FIELD_NUMBER: _ClassVar[int]
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    TO_VERSION_FIELD_NUMBER: _ClassVar[int]
    NOTE_FIELD_NUMBER: _ClassVar[int]
    TIME_UNIX_S_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    version: str
    reason: str
    detail: str
    refused_unix_s: float
    outcome: str
    to_version: str
    note: str
    time_unix_s: float
    def __init__(self, worker_id: _Optional[str] = ..., version: _Optional[str] = ..., reason: _Optional[str] = ..., detail: _Optional[str] = ..., refused_unix_s: _Optional[float] = ..., outcome: _Optional[str] = ..., to_version: _Optional[str] = ..., note: _Optional[str] = ..., time_unix_s: _Optional[float] = ...) -> None: ...

class DecisionRecord(_message.Message):
    __slots__ = ("decision", "applied_to", "failed")
    DECISION_FIELD_NUMBER: _ClassVar[int]
    APPLIED_TO_FIELD_NUMBER: _ClassVar[int]
    FAILED_FIELD_NUMBER: _ClassVar[int]
    decision: _inference_pb2.Decision
    applied_to: _containers.RepeatedScalarFieldContainer[str]
    failed: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, decision: _Optional[_Union[_inference_pb2.Decision, _Mapping]] = ..., applied_to: _Optional[_Iterable[str]] = ..., failed: _Optional[_Iterable[str]] = ...) -> None: ...

class WorkerInfo(_message.Message):
    __slots__ = ("worker_id", "address", "target_model", "registered_unix_s", "last_seen_unix_s", "last_decision_id")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    TARGET_MODEL_FIELD_NUMBER: _ClassVar[int]
    REGISTERED_UNIX_S_FIELD_NUMBER: _ClassVar[int]
    LAST_SEEN_UNIX_S_FIELD_NUMBER: _ClassVar[int]
    LAST_DECISION_ID_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    address: str
    target_model: str
    registered_unix_s: float
    last_seen_unix_s: float
    last_decision_id: str
    def __init__(self, worker_id: _Optional[str] = ..., address: _Optional[str] = ..., target_model: _Optional[str] = ..., registered_unix_s: _Optional[float] = ..., last_seen_unix_s: _Optional[float] = ..., last_decision_id: _Optional[str] = ...) -> None: ...

class ControllerState(_message.Message):
    __slots__ = ("targets", "recent_decisions", "workers")
    TARGETS_FIELD_NUMBER: _ClassVar[int]
    RECENT_DECISIONS_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    targets: _containers.RepeatedCompositeFieldContainer[TargetState]
    recent_decisions: _containers.RepeatedCompositeFieldContainer[DecisionRecord]
    workers: _containers.RepeatedCompositeFieldContainer[WorkerInfo]
    def __init__(self, targets: _Optional[_Iterable[_Union[TargetState, _Mapping]]] = ..., recent_decisions: _Optional[_Iterable[_Union[DecisionRecord, _Mapping]]] = ..., workers: _Optional[_Iterable[_Union[WorkerInfo, _Mapping]]] = ...) -> None: ...

class ReportTrainingOutcomeResponse(_message.Message):
    __slots__ = ("recorded",)
    RECORDED_FIELD_NUMBER: _ClassVar[int]
    recorded: bool
    def __init__(self, recorded: _Optional[bool] = ...) -> None: ...

class RegisterWorkerRequest(_message.Message):
    __slots__ = ("worker_id", "address", "target_model")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    TARGET_MODEL_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    address: str
    target_model: str
    def __init__(self, worker_id: _Optional[str] = ..., address: _Optional[str] = ..., target_model: _Optional[str] = ...) -> None: ...

class RegisterWorkerResponse(_message.Message):
    __slots__ = ("current",)
    CURRENT_FIELD_NUMBER: _ClassVar[int]
    current: _inference_pb2.Decision
    def __init__(self, current: _Optional[_Union[_inference_pb2.Decision, _Mapping]] = ...) -> None: ...
