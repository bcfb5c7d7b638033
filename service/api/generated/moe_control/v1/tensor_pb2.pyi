from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Dtype(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DTYPE_UNSPECIFIED: _ClassVar[Dtype]
    DTYPE_BOOL: _ClassVar[Dtype]
    DTYPE_UINT8: _ClassVar[Dtype]
    DTYPE_INT8: _ClassVar[Dtype]
    DTYPE_INT16: _ClassVar[Dtype]
    DTYPE_INT32: _ClassVar[Dtype]
    DTYPE_INT64: _ClassVar[Dtype]
    DTYPE_FLOAT16: _ClassVar[Dtype]
    DTYPE_BFLOAT16: _ClassVar[Dtype]
    DTYPE_FLOAT32: _ClassVar[Dtype]
    DTYPE_FLOAT64: _ClassVar[Dtype]
    DTYPE_FLOAT8_E4M3FN: _ClassVar[Dtype]
    DTYPE_FLOAT8_E5M2: _ClassVar[Dtype]
    DTYPE_UINT16: _ClassVar[Dtype]
    DTYPE_UINT32: _ClassVar[Dtype]
    DTYPE_UINT4_PACKED_INT32: _ClassVar[Dtype]
    DTYPE_UINT8_PACKED_INT32: _ClassVar[Dtype]
    DTYPE_UINT4_PACKED_UINT8: _ClassVar[Dtype]

class PackOrder(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PACK_ORDER_UNSPECIFIED: _ClassVar[PackOrder]
    PACK_ORDER_SEQUENTIAL: _ClassVar[PackOrder]
    PACK_ORDER_AWQ: _ClassVar[PackOrder]
DTYPE_UNSPECIFIED: Dtype
DTYPE_BOOL: Dtype
DTYPE_UINT8: Dtype
DTYPE_INT8: Dtype
DTYPE_INT16: Dtype
DTYPE_INT32: Dtype
DTYPE_INT64: Dtype
DTYPE_FLOAT16: Dtype
DTYPE_BFLOAT16: Dtype
DTYPE_FLOAT32: Dtype
DTYPE_FLOAT64: Dtype
DTYPE_FLOAT8_E4M3FN: Dtype
DTYPE_FLOAT8_E5M2: Dtype
DTYPE_UINT16: Dtype
DTYPE_UINT32: Dtype
DTYPE_UINT4_PACKED_INT32: Dtype
DTYPE_UINT8_PACKED_INT32: Dtype
DTYPE_UINT4_PACKED_UINT8: Dtype
PACK_ORDER_UNSPECIFIED: PackOrder
PACK_ORDER_SEQUENTIAL: PackOrder
PACK_ORDER_AWQ: PackOrder

class Packing(_message.Message):
    __slots__ = ("packed_dim", "order")
    PACKED_DIM_FIELD_NUMBER: _ClassVar[int]
    ORDER_FIELD_NUMBER: _ClassVar[int]
    packed_dim: int
    order: PackOrder
    def __init__(self, packed_dim: _Optional[int] = ..., order: _Optional[_Union[PackOrder, str]] = ...) -> None: ...

class TensorHeader(_message.Message):
    __slots__ = ("name", "dtype", "shape", "packing", "byte_size", "sha256")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    PACKING_FIELD_NUMBER: _ClassVar[int]
    BYTE_SIZE_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: Dtype
    shape: _containers.RepeatedScalarFieldContainer[int]
    packing: Packing
    byte_size: int
    sha256: str
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[_Union[Dtype, str]] = ..., shape: _Optional[_Iterable[int]] = ..., packing: _Optional[_Union[Packing, _Mapping]] = ..., byte_size: _Optional[int] = ..., sha256: _Optional[str] = ...) -> None: ...

class Tensor(_message.Message):
    __slots__ = ("name", "dtype", "shape", "packing", "data")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    PACKING_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: Dtype
    shape: _containers.RepeatedScalarFieldContainer[int]
    packing: Packing
    data: bytes
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[_Union[Dtype, str]] = ..., shape: _Optional[_Iterable[int]] = ..., packing: _Optional[_Union[Packing, _Mapping]] = ..., data: _Optional[bytes] = ...) -> None: ...

class TensorChunk(_message.Message):
    __slots__ = ("name", "offset", "data")
    NAME_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    name: str
    offset: int
    data: bytes
    def __init__(self, name: _Optional[str] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...
