import datetime

from google.protobuf import timestamp_pb2 as _timestamp_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ObservedVerdict(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    OBSERVED_VERDICT_UNSPECIFIED: _ClassVar[ObservedVerdict]
    OBSERVED_VERDICT_SELECTED: _ClassVar[ObservedVerdict]
    OBSERVED_VERDICT_REJECTED: _ClassVar[ObservedVerdict]
    OBSERVED_VERDICT_NOT_REACHED: _ClassVar[ObservedVerdict]
OBSERVED_VERDICT_UNSPECIFIED: ObservedVerdict
OBSERVED_VERDICT_SELECTED: ObservedVerdict
OBSERVED_VERDICT_REJECTED: ObservedVerdict
OBSERVED_VERDICT_NOT_REACHED: ObservedVerdict

class ReportDecisionsRequest(_message.Message):
    __slots__ = ("process", "decisions")
    PROCESS_FIELD_NUMBER: _ClassVar[int]
    DECISIONS_FIELD_NUMBER: _ClassVar[int]
    process: ReportingProcess
    decisions: _containers.RepeatedCompositeFieldContainer[ObservedDecision]
    def __init__(self, process: _Optional[_Union[ReportingProcess, _Mapping]] = ..., decisions: _Optional[_Iterable[_Union[ObservedDecision, _Mapping]]] = ...) -> None: ...

class ReportDecisionsResponse(_message.Message):
    __slots__ = ("accepted",)
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    accepted: int
    def __init__(self, accepted: _Optional[int] = ...) -> None: ...

class ReportingProcess(_message.Message):
    __slots__ = ("host", "pod", "namespace", "pid", "vllm_version", "plugin_version", "model")
    HOST_FIELD_NUMBER: _ClassVar[int]
    POD_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    VLLM_VERSION_FIELD_NUMBER: _ClassVar[int]
    PLUGIN_VERSION_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    host: str
    pod: str
    namespace: str
    pid: int
    vllm_version: str
    plugin_version: str
    model: str
    def __init__(self, host: _Optional[str] = ..., pod: _Optional[str] = ..., namespace: _Optional[str] = ..., pid: _Optional[int] = ..., vllm_version: _Optional[str] = ..., plugin_version: _Optional[str] = ..., model: _Optional[str] = ...) -> None: ...

class ObservedCandidate(_message.Message):
    __slots__ = ("backend", "verdict", "reason")
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    VERDICT_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    backend: str
    verdict: ObservedVerdict
    reason: str
    def __init__(self, backend: _Optional[str] = ..., verdict: _Optional[_Union[ObservedVerdict, str]] = ..., reason: _Optional[str] = ...) -> None: ...

class ObservedWeightKey(_message.Message):
    __slots__ = ("dtype", "scale_dtype", "group_shape", "symmetric")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SCALE_DTYPE_FIELD_NUMBER: _ClassVar[int]
    GROUP_SHAPE_FIELD_NUMBER: _ClassVar[int]
    SYMMETRIC_FIELD_NUMBER: _ClassVar[int]
    dtype: str
    scale_dtype: str
    group_shape: _containers.RepeatedScalarFieldContainer[int]
    symmetric: bool
    def __init__(self, dtype: _Optional[str] = ..., scale_dtype: _Optional[str] = ..., group_shape: _Optional[_Iterable[int]] = ..., symmetric: _Optional[bool] = ...) -> None: ...

class ObservedError(_message.Message):
    __slots__ = ("type", "message")
    TYPE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    type: str
    message: str
    def __init__(self, type: _Optional[str] = ..., message: _Optional[str] = ...) -> None: ...

class ObservedDecision(_message.Message):
    __slots__ = ("layer_name", "layer_count", "moe_method", "integration", "deployment_json", "weight_key", "may_have_zp", "may_have_bias", "allow_tile_padding", "backend", "experts_class", "error", "candidates")
    LAYER_NAME_FIELD_NUMBER: _ClassVar[int]
    LAYER_COUNT_FIELD_NUMBER: _ClassVar[int]
    MOE_METHOD_FIELD_NUMBER: _ClassVar[int]
    INTEGRATION_FIELD_NUMBER: _ClassVar[int]
    DEPLOYMENT_JSON_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_KEY_FIELD_NUMBER: _ClassVar[int]
    MAY_HAVE_ZP_FIELD_NUMBER: _ClassVar[int]
    MAY_HAVE_BIAS_FIELD_NUMBER: _ClassVar[int]
    ALLOW_TILE_PADDING_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    EXPERTS_CLASS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    CANDIDATES_FIELD_NUMBER: _ClassVar[int]
    layer_name: str
    layer_count: int
    moe_method: str
    integration: str
    deployment_json: str
    weight_key: ObservedWeightKey
    may_have_zp: bool
    may_have_bias: bool
    allow_tile_padding: bool
    backend: str
    experts_class: str
    error: ObservedError
    candidates: _containers.RepeatedCompositeFieldContainer[ObservedCandidate]
    def __init__(self, layer_name: _Optional[str] = ..., layer_count: _Optional[int] = ..., moe_method: _Optional[str] = ..., integration: _Optional[str] = ..., deployment_json: _Optional[str] = ..., weight_key: _Optional[_Union[ObservedWeightKey, _Mapping]] = ..., may_have_zp: _Optional[bool] = ..., may_have_bias: _Optional[bool] = ..., allow_tile_padding: _Optional[bool] = ..., backend: _Optional[str] = ..., experts_class: _Optional[str] = ..., error: _Optional[_Union[ObservedError, _Mapping]] = ..., candidates: _Optional[_Iterable[_Union[ObservedCandidate, _Mapping]]] = ...) -> None: ...

class ListObservedDecisionsRequest(_message.Message):
    __slots__ = ("mismatches_only",)
    MISMATCHES_ONLY_FIELD_NUMBER: _ClassVar[int]
    mismatches_only: bool
    def __init__(self, mismatches_only: _Optional[bool] = ...) -> None: ...

class ListObservedDecisionsResponse(_message.Message):
    __slots__ = ("deployments", "evicted")
    DEPLOYMENTS_FIELD_NUMBER: _ClassVar[int]
    EVICTED_FIELD_NUMBER: _ClassVar[int]
    deployments: _containers.RepeatedCompositeFieldContainer[ObservedDeployment]
    evicted: int
    def __init__(self, deployments: _Optional[_Iterable[_Union[ObservedDeployment, _Mapping]]] = ..., evicted: _Optional[int] = ...) -> None: ...

class PredictedDecision(_message.Message):
    __slots__ = ("moe_method", "integration", "backend", "experts_class", "error", "weight_key", "may_have_zp", "may_have_bias", "allow_tile_padding", "candidates")
    MOE_METHOD_FIELD_NUMBER: _ClassVar[int]
    INTEGRATION_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    EXPERTS_CLASS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_KEY_FIELD_NUMBER: _ClassVar[int]
    MAY_HAVE_ZP_FIELD_NUMBER: _ClassVar[int]
    MAY_HAVE_BIAS_FIELD_NUMBER: _ClassVar[int]
    ALLOW_TILE_PADDING_FIELD_NUMBER: _ClassVar[int]
    CANDIDATES_FIELD_NUMBER: _ClassVar[int]
    moe_method: str
    integration: str
    backend: str
    experts_class: str
    error: ObservedError
    weight_key: ObservedWeightKey
    may_have_zp: bool
    may_have_bias: bool
    allow_tile_padding: bool
    candidates: _containers.RepeatedCompositeFieldContainer[ObservedCandidate]
    def __init__(self, moe_method: _Optional[str] = ..., integration: _Optional[str] = ..., backend: _Optional[str] = ..., experts_class: _Optional[str] = ..., error: _Optional[_Union[ObservedError, _Mapping]] = ..., weight_key: _Optional[_Union[ObservedWeightKey, _Mapping]] = ..., may_have_zp: _Optional[bool] = ..., may_have_bias: _Optional[bool] = ..., allow_tile_padding: _Optional[bool] = ..., candidates: _Optional[_Iterable[_Union[ObservedCandidate, _Mapping]]] = ...) -> None: ...

class ObservedDeployment(_message.Message):
    __slots__ = ("key", "count", "vllm_version", "ruleset", "note", "observed", "predicted", "first_difference", "observed_value", "predicted_value", "processes", "first_seen", "last_seen", "release_not_modelled")
    KEY_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    VLLM_VERSION_FIELD_NUMBER: _ClassVar[int]
    RULESET_FIELD_NUMBER: _ClassVar[int]
    NOTE_FIELD_NUMBER: _ClassVar[int]
    OBSERVED_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_FIELD_NUMBER: _ClassVar[int]
    FIRST_DIFFERENCE_FIELD_NUMBER: _ClassVar[int]
    OBSERVED_VALUE_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_VALUE_FIELD_NUMBER: _ClassVar[int]
    PROCESSES_FIELD_NUMBER: _ClassVar[int]
    FIRST_SEEN_FIELD_NUMBER: _ClassVar[int]
    LAST_SEEN_FIELD_NUMBER: _ClassVar[int]
    RELEASE_NOT_MODELLED_FIELD_NUMBER: _ClassVar[int]
    key: str
    count: int
    vllm_version: str
    ruleset: str
    note: str
    observed: ObservedDecision
    predicted: PredictedDecision
    first_difference: str
    observed_value: str
    predicted_value: str
    processes: _containers.RepeatedCompositeFieldContainer[ReportingProcess]
    first_seen: _timestamp_pb2.Timestamp
    last_seen: _timestamp_pb2.Timestamp
    release_not_modelled: bool
    def __init__(self, key: _Optional[str] = ..., count: _Optional[int] = ..., vllm_version: _Optional[str] = ..., ruleset: _Optional[str] = ..., note: _Optional[str] = ..., observed: _Optional[_Union[ObservedDecision, _Mapping]] = ..., predicted: _Optional[_Union[PredictedDecision, _Mapping]] = ..., first_difference: _Optional[str] = ..., observed_value: _Optional[str] = ..., predicted_value: _Optional[str] = ..., processes: _Optional[_Iterable[_Union[ReportingProcess, _Mapping]]] = ..., first_seen: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., last_seen: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., release_not_modelled: _Optional[bool] = ...) -> None: ...
