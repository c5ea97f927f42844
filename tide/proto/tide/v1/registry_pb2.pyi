from tide.proto.tide.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PointerAction(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    POINTER_ACTION_UNSPECIFIED: _ClassVar[PointerAction]
    POINTER_ACTION_PROMOTE: _ClassVar[PointerAction]
    POINTER_ACTION_PIN: _ClassVar[PointerAction]
    POINTER_ACTION_UNPIN: _ClassVar[PointerAction]
    POINTER_ACTION_ROLLBACK: _ClassVar[PointerAction]
POINTER_ACTION_UNSPECIFIED: PointerAction
POINTER_ACTION_PROMOTE: PointerAction
POINTER_ACTION_PIN: PointerAction
POINTER_ACTION_UNPIN: PointerAction
POINTER_ACTION_ROLLBACK: PointerAction

class DraftVersion(_message.Message):
    __slots__ = ("version", "target_model", "artifact", "eval_metrics", "provenance_json", "parent_version", "drafter", "created_unix_s")
    class EvalMetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    VERSION_FIELD_NUMBER: _ClassVar[int]
    TARGET_MODEL_FIELD_NUMBER: _ClassVar[int]
    ARTIFACT_FIELD_NUMBER: _ClassVar[int]
    EVAL_METRICS_FIELD_NUMBER: _ClassVar[int]
    PROVENANCE_JSON_FIELD_NUMBER: _ClassVar[int]
    PARENT_VERSION_FIELD_NUMBER: _ClassVar[int]
    DRAFTER_FIELD_NUMBER: _ClassVar[int]
    CREATED_UNIX_S_FIELD_NUMBER: _ClassVar[int]
    version: str
    target_model: str
    artifact: _common_pb2.DraftArtifact
    eval_metrics: _containers.ScalarMap[str, float]
    provenance_json: str
    parent_version: str
    drafter: str
    created_unix_s: float
    def __init__(self, version: _Optional[str] = ..., target_model: _Optional[str] = ..., artifact: _Optional[_Union[_common_pb2.DraftArtifact, _Mapping]] = ..., eval_metrics: _Optional[_Mapping[str, float]] = ..., provenance_json: _Optional[str] = ..., parent_version: _Optional[str] = ..., drafter: _Optional[str] = ..., created_unix_s: _Optional[float] = ...) -> None: ...

class RegisterDraftRequest(_message.Message):
    __slots__ = ("target_model", "artifact", "eval_metrics", "provenance_json", "parent_version", "drafter")
    class EvalMetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    TARGET_MODEL_FIELD_NUMBER: _ClassVar[int]
    ARTIFACT_FIELD_NUMBER: _ClassVar[int]
    EVAL_METRICS_FIELD_NUMBER: _ClassVar[int]
    PROVENANCE_JSON_FIELD_NUMBER: _ClassVar[int]
    PARENT_VERSION_FIELD_NUMBER: _ClassVar[int]
    DRAFTER_FIELD_NUMBER: _ClassVar[int]
    target_model: str
    artifact: _common_pb2.DraftArtifact
    eval_metrics: _containers.ScalarMap[str, float]
    provenance_json: str
    parent_version: str
    drafter: str
    def __init__(self, target_model: _Optional[str] = ..., artifact: _Optional[_Union[_common_pb2.DraftArtifact, _Mapping]] = ..., eval_metrics: _Optional[_Mapping[str, float]] = ..., provenance_json: _Optional[str] = ..., parent_version: _Optional[str] = ..., drafter: _Optional[str] = ...) -> None: ...

class ListDraftsRequest(_message.Message):
    __slots__ = ("target_model",)
    TARGET_MODEL_FIELD_NUMBER: _ClassVar[int]
    target_model: str
    def __init__(self, target_model: _Optional[str] = ...) -> None: ...

class ListDraftsResponse(_message.Message):
    __slots__ = ("drafts", "pointer")
    DRAFTS_FIELD_NUMBER: _ClassVar[int]
    POINTER_FIELD_NUMBER: _ClassVar[int]
    drafts: _containers.RepeatedCompositeFieldContainer[DraftVersion]
    pointer: PointerState
    def __init__(self, drafts: _Optional[_Iterable[_Union[DraftVersion, _Mapping]]] = ..., pointer: _Optional[_Union[PointerState, _Mapping]] = ...) -> None: ...

class GetDraftRequest(_message.Message):
    __slots__ = ("version",)
    VERSION_FIELD_NUMBER: _ClassVar[int]
    version: str
    def __init__(self, version: _Optional[str] = ...) -> None: ...

class GetPointerRequest(_message.Message):
    __slots__ = ("target_model",)
    TARGET_MODEL_FIELD_NUMBER: _ClassVar[int]
    target_model: str
    def __init__(self, target_model: _Optional[str] = ...) -> None: ...

class PromoteRequest(_message.Message):
    __slots__ = ("target_model", "version", "reason", "expected_current")
    TARGET_MODEL_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_CURRENT_FIELD_NUMBER: _ClassVar[int]
    target_model: str
    version: str
    reason: str
    expected_current: str
    def __init__(self, target_model: _Optional[str] = ..., version: _Optional[str] = ..., reason: _Optional[str] = ..., expected_current: _Optional[str] = ...) -> None: ...

class PinRequest(_message.Message):
    __slots__ = ("target_model", "version", "reason")
    TARGET_MODEL_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    target_model: str
    version: str
    reason: str
    def __init__(self, target_model: _Optional[str] = ..., version: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class UnpinRequest(_message.Message):
    __slots__ = ("target_model", "reason")
    TARGET_MODEL_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    target_model: str
    reason: str
    def __init__(self, target_model: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class RollbackRequest(_message.Message):
    __slots__ = ("target_model", "reason", "to_version", "expected_current")
    TARGET_MODEL_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    TO_VERSION_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_CURRENT_FIELD_NUMBER: _ClassVar[int]
    target_model: str
    reason: str
    to_version: str
    expected_current: str
    def __init__(self, target_model: _Optional[str] = ..., reason: _Optional[str] = ..., to_version: _Optional[str] = ..., expected_current: _Optional[str] = ...) -> None: ...

class PointerEvent(_message.Message):
    __slots__ = ("action", "from_version", "to_version", "reason", "actor", "time_unix_s")
    ACTION_FIELD_NUMBER: _ClassVar[int]
    FROM_VERSION_FIELD_NUMBER: _ClassVar[int]
    TO_VERSION_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    ACTOR_FIELD_NUMBER: _ClassVar[int]
    TIME_UNIX_S_FIELD_NUMBER: _ClassVar[int]
    action: PointerAction
    from_version: str
    to_version: str
    reason: str
    actor: str
    time_unix_s: float
    def __init__(self, action: _Optional[_Union[PointerAction, str]] = ..., from_version: _Optional[str] = ..., to_version: _Optional[str] = ..., reason: _Optional[str] = ..., actor: _Optional[str] = ..., time_unix_s: _Optional[float] = ...) -> None: ...

class PointerState(_message.Message):
    __slots__ = ("target_model", "current", "pinned", "effective", "previous", "history", "generation")
    TARGET_MODEL_FIELD_NUMBER: _ClassVar[int]
    CURRENT_FIELD_NUMBER: _ClassVar[int]
    PINNED_FIELD_NUMBER: _ClassVar[int]
    EFFECTIVE_FIELD_NUMBER: _ClassVar[int]
    PREVIOUS_FIELD_NUMBER: _ClassVar[int]
    HISTORY_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    target_model: str
    current: str
    pinned: str
    effective: str
    previous: _containers.RepeatedScalarFieldContainer[str]
    history: _containers.RepeatedCompositeFieldContainer[PointerEvent]
    generation: int
    def __init__(self, target_model: _Optional[str] = ..., current: _Optional[str] = ..., pinned: _Optional[str] = ..., effective: _Optional[str] = ..., previous: _Optional[_Iterable[str]] = ..., history: _Optional[_Iterable[_Union[PointerEvent, _Mapping]]] = ..., generation: _Optional[int] = ...) -> None: ...

class WatchTargetRequest(_message.Message):
    __slots__ = ("target_model",)
    TARGET_MODEL_FIELD_NUMBER: _ClassVar[int]
    target_model: str
    def __init__(self, target_model: _Optional[str] = ...) -> None: ...

class TargetAssignment(_message.Message):
    __slots__ = ("target_model", "version", "artifact", "pinned", "generation")
    TARGET_MODEL_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    ARTIFACT_FIELD_NUMBER: _ClassVar[int]
    PINNED_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    target_model: str
    version: str
    artifact: _common_pb2.DraftArtifact
    pinned: bool
    generation: int
    def __init__(self, target_model: _Optional[str] = ..., version: _Optional[str] = ..., artifact: _Optional[_Union[_common_pb2.DraftArtifact, _Mapping]] = ..., pinned: _Optional[bool] = ..., generation: _Optional[int] = ...) -> None: ...
