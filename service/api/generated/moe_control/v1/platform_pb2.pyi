import datetime

from google.protobuf import timestamp_pb2 as _timestamp_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DeviceKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DEVICE_KIND_UNSPECIFIED: _ClassVar[DeviceKind]
    DEVICE_KIND_CUDA: _ClassVar[DeviceKind]
    DEVICE_KIND_ROCM: _ClassVar[DeviceKind]
    DEVICE_KIND_XPU: _ClassVar[DeviceKind]
    DEVICE_KIND_CPU: _ClassVar[DeviceKind]

class WorkerState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    WORKER_STATE_UNSPECIFIED: _ClassVar[WorkerState]
    WORKER_STATE_STARTING: _ClassVar[WorkerState]
    WORKER_STATE_READY: _ClassVar[WorkerState]
    WORKER_STATE_RESTARTING: _ClassVar[WorkerState]
    WORKER_STATE_STOPPED: _ClassVar[WorkerState]
DEVICE_KIND_UNSPECIFIED: DeviceKind
DEVICE_KIND_CUDA: DeviceKind
DEVICE_KIND_ROCM: DeviceKind
DEVICE_KIND_XPU: DeviceKind
DEVICE_KIND_CPU: DeviceKind
WORKER_STATE_UNSPECIFIED: WorkerState
WORKER_STATE_STARTING: WorkerState
WORKER_STATE_READY: WorkerState
WORKER_STATE_RESTARTING: WorkerState
WORKER_STATE_STOPPED: WorkerState

class ComputeCapability(_message.Message):
    __slots__ = ("major", "minor")
    MAJOR_FIELD_NUMBER: _ClassVar[int]
    MINOR_FIELD_NUMBER: _ClassVar[int]
    major: int
    minor: int
    def __init__(self, major: _Optional[int] = ..., minor: _Optional[int] = ...) -> None: ...

class PackageSet(_message.Message):
    __slots__ = ("names",)
    NAMES_FIELD_NUMBER: _ClassVar[int]
    names: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, names: _Optional[_Iterable[str]] = ...) -> None: ...

class PlatformProfile(_message.Message):
    __slots__ = ("device", "capability", "arch", "amx", "x86", "packages", "env", "name", "preset")
    class EnvEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    CAPABILITY_FIELD_NUMBER: _ClassVar[int]
    ARCH_FIELD_NUMBER: _ClassVar[int]
    AMX_FIELD_NUMBER: _ClassVar[int]
    X86_FIELD_NUMBER: _ClassVar[int]
    PACKAGES_FIELD_NUMBER: _ClassVar[int]
    ENV_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    PRESET_FIELD_NUMBER: _ClassVar[int]
    device: DeviceKind
    capability: ComputeCapability
    arch: str
    amx: bool
    x86: bool
    packages: PackageSet
    env: _containers.ScalarMap[str, str]
    name: str
    preset: str
    def __init__(self, device: _Optional[_Union[DeviceKind, str]] = ..., capability: _Optional[_Union[ComputeCapability, _Mapping]] = ..., arch: _Optional[str] = ..., amx: _Optional[bool] = ..., x86: _Optional[bool] = ..., packages: _Optional[_Union[PackageSet, _Mapping]] = ..., env: _Optional[_Mapping[str, str]] = ..., name: _Optional[str] = ..., preset: _Optional[str] = ...) -> None: ...

class PlatformPreset(_message.Message):
    __slots__ = ("name", "profile")
    NAME_FIELD_NUMBER: _ClassVar[int]
    PROFILE_FIELD_NUMBER: _ClassVar[int]
    name: str
    profile: PlatformProfile
    def __init__(self, name: _Optional[str] = ..., profile: _Optional[_Union[PlatformProfile, _Mapping]] = ...) -> None: ...

class WorkerInfo(_message.Message):
    __slots__ = ("index", "device", "state", "pid", "restarts", "platform", "device_name", "total_memory_bytes", "torch_version", "ready_time", "last_exit_reason", "layer_bytes", "layer_budget_bytes", "layer_ids")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    RESTARTS_FIELD_NUMBER: _ClassVar[int]
    PLATFORM_FIELD_NUMBER: _ClassVar[int]
    DEVICE_NAME_FIELD_NUMBER: _ClassVar[int]
    TOTAL_MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    TORCH_VERSION_FIELD_NUMBER: _ClassVar[int]
    READY_TIME_FIELD_NUMBER: _ClassVar[int]
    LAST_EXIT_REASON_FIELD_NUMBER: _ClassVar[int]
    LAYER_BYTES_FIELD_NUMBER: _ClassVar[int]
    LAYER_BUDGET_BYTES_FIELD_NUMBER: _ClassVar[int]
    LAYER_IDS_FIELD_NUMBER: _ClassVar[int]
    index: int
    device: str
    state: WorkerState
    pid: int
    restarts: int
    platform: PlatformProfile
    device_name: str
    total_memory_bytes: int
    torch_version: str
    ready_time: _timestamp_pb2.Timestamp
    last_exit_reason: str
    layer_bytes: int
    layer_budget_bytes: int
    layer_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, index: _Optional[int] = ..., device: _Optional[str] = ..., state: _Optional[_Union[WorkerState, str]] = ..., pid: _Optional[int] = ..., restarts: _Optional[int] = ..., platform: _Optional[_Union[PlatformProfile, _Mapping]] = ..., device_name: _Optional[str] = ..., total_memory_bytes: _Optional[int] = ..., torch_version: _Optional[str] = ..., ready_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., last_exit_reason: _Optional[str] = ..., layer_bytes: _Optional[int] = ..., layer_budget_bytes: _Optional[int] = ..., layer_ids: _Optional[_Iterable[str]] = ...) -> None: ...
