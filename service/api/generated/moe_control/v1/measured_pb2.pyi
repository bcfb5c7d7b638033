import datetime

from google.protobuf import timestamp_pb2 as _timestamp_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SelectionPolicy(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SELECTION_POLICY_UNSPECIFIED: _ClassVar[SelectionPolicy]
    SELECTION_POLICY_STATIC: _ClassVar[SelectionPolicy]
    SELECTION_POLICY_MEASURED: _ClassVar[SelectionPolicy]
SELECTION_POLICY_UNSPECIFIED: SelectionPolicy
SELECTION_POLICY_STATIC: SelectionPolicy
SELECTION_POLICY_MEASURED: SelectionPolicy

class BackendTiming(_message.Message):
    __slots__ = ("backend", "device_seconds", "error")
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    DEVICE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    backend: str
    device_seconds: float
    error: str
    def __init__(self, backend: _Optional[str] = ..., device_seconds: _Optional[float] = ..., error: _Optional[str] = ...) -> None: ...

class TokenBucketMeasurement(_message.Message):
    __slots__ = ("tokens", "fastest_backend", "fastest_seconds", "static_backend", "static_seconds", "speedup", "timings")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    FASTEST_BACKEND_FIELD_NUMBER: _ClassVar[int]
    FASTEST_SECONDS_FIELD_NUMBER: _ClassVar[int]
    STATIC_BACKEND_FIELD_NUMBER: _ClassVar[int]
    STATIC_SECONDS_FIELD_NUMBER: _ClassVar[int]
    SPEEDUP_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    tokens: int
    fastest_backend: str
    fastest_seconds: float
    static_backend: str
    static_seconds: float
    speedup: float
    timings: _containers.RepeatedCompositeFieldContainer[BackendTiming]
    def __init__(self, tokens: _Optional[int] = ..., fastest_backend: _Optional[str] = ..., fastest_seconds: _Optional[float] = ..., static_backend: _Optional[str] = ..., static_seconds: _Optional[float] = ..., speedup: _Optional[float] = ..., timings: _Optional[_Iterable[_Union[BackendTiming, _Mapping]]] = ...) -> None: ...

class MeasuredSelection(_message.Message):
    __slots__ = ("worker_index", "device_name", "from_cache", "measured_time", "measure_seconds", "buckets", "versions")
    class VersionsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    WORKER_INDEX_FIELD_NUMBER: _ClassVar[int]
    DEVICE_NAME_FIELD_NUMBER: _ClassVar[int]
    FROM_CACHE_FIELD_NUMBER: _ClassVar[int]
    MEASURED_TIME_FIELD_NUMBER: _ClassVar[int]
    MEASURE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    BUCKETS_FIELD_NUMBER: _ClassVar[int]
    VERSIONS_FIELD_NUMBER: _ClassVar[int]
    worker_index: int
    device_name: str
    from_cache: bool
    measured_time: _timestamp_pb2.Timestamp
    measure_seconds: float
    buckets: _containers.RepeatedCompositeFieldContainer[TokenBucketMeasurement]
    versions: _containers.ScalarMap[str, str]
    def __init__(self, worker_index: _Optional[int] = ..., device_name: _Optional[str] = ..., from_cache: _Optional[bool] = ..., measured_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., measure_seconds: _Optional[float] = ..., buckets: _Optional[_Iterable[_Union[TokenBucketMeasurement, _Mapping]]] = ..., versions: _Optional[_Mapping[str, str]] = ...) -> None: ...
