"""Tensors in chunks: assembling a declared tensor from a stream with bounded memory, and
cutting one back into chunks.

A streamed tensor is declared before its data (name, dtype, shape, byte size, optional
SHA-256). The declaration fixes the memory it may take, so a client cannot make the server
buffer more than it announced: a chunk that runs past the declared size, a chunk out of
order, a stream that ends short or data whose digest differs from the declared one is a
`StreamError` naming the tensor and the field. The sum of a call's declarations is held to a
budget (`StreamBudget`), so memory is bounded by the layer, never by the stream.

No torch here: the server process assembles bytes, the worker gives them a dtype.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from service.formats.errors import StreamError, StreamLimitError


@dataclass(frozen=True, slots=True)
class DtypeInfo:
    """A wire dtype: its storage element size, torch storage dtype and safetensors code.

    Packed dtypes are stored as their container (int32 words, bytes); `codes_per_element`
    says how many quantized codes one element holds."""

    itemsize: int
    torch_name: str
    safetensors: str
    codes_per_element: int = 1


#: Wire dtype names (the `Dtype` enum of tensor.proto without its prefix, lower case).
DTYPES: dict[str, DtypeInfo] = {
    "bool": DtypeInfo(1, "bool", "BOOL"),
    "uint8": DtypeInfo(1, "uint8", "U8"),
    "int8": DtypeInfo(1, "int8", "I8"),
    "int16": DtypeInfo(2, "int16", "I16"),
    "uint16": DtypeInfo(2, "uint16", "U16"),
    "int32": DtypeInfo(4, "int32", "I32"),
    "uint32": DtypeInfo(4, "uint32", "U32"),
    "int64": DtypeInfo(8, "int64", "I64"),
    "float16": DtypeInfo(2, "float16", "F16"),
    "bfloat16": DtypeInfo(2, "bfloat16", "BF16"),
    "float32": DtypeInfo(4, "float32", "F32"),
    "float64": DtypeInfo(8, "float64", "F64"),
    "float8_e4m3fn": DtypeInfo(1, "float8_e4m3fn", "F8_E4M3"),
    "float8_e5m2": DtypeInfo(1, "float8_e5m2", "F8_E5M2"),
    "uint4_packed_int32": DtypeInfo(4, "int32", "I32", 8),
    "uint8_packed_int32": DtypeInfo(4, "int32", "I32", 4),
    "uint4_packed_uint8": DtypeInfo(1, "uint8", "U8", 2),
}
#: safetensors dtype code -> wire dtype name (packed tensors read back as their container).
FROM_SAFETENSORS: dict[str, str] = {
    info.safetensors: name for name, info in DTYPES.items() if info.codes_per_element == 1
}
#: torch dtype name -> wire dtype name.
FROM_TORCH: dict[str, str] = {
    info.torch_name: name for name, info in DTYPES.items() if info.codes_per_element == 1
}

PACK_ORDERS = ("sequential", "awq")


def tensor_field(name: str, attribute: str) -> str:
    """The BadRequest field path of one attribute of a named streamed tensor."""
    return f"tensors[{name}].{attribute}"


@dataclass(frozen=True, slots=True)
class Packing:
    packed_dim: int
    order: str = "sequential"


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """A tensor's declaration: everything but its data."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    byte_size: int
    sha256: str = ""
    packing: Packing | None = None

    @classmethod
    def of(
        cls,
        name: str,
        dtype: str,
        shape: tuple[int, ...] | list[int],
        *,
        sha256: str = "",
        packing: Packing | None = None,
    ) -> TensorSpec:
        """A spec whose byte size follows from dtype and shape."""
        itemsize = DTYPES[dtype].itemsize if dtype in DTYPES else 0
        return cls(name, dtype, tuple(shape), math.prod(shape) * itemsize, sha256, packing)

    def validate(self) -> None:
        """Raise `StreamError` unless the declaration is self-consistent."""
        if not self.name:
            raise StreamError("tensors[].name", "required: every tensor needs a name")
        info = DTYPES.get(self.dtype)
        if info is None:
            raise StreamError(
                tensor_field(self.name, "dtype"), f"unknown or unspecified dtype {self.dtype!r}"
            )
        if any(d < 0 for d in self.shape):
            raise StreamError(
                tensor_field(self.name, "shape"), f"negative dimension in {list(self.shape)}"
            )
        expected = math.prod(self.shape) * info.itemsize
        if self.byte_size != expected:
            raise StreamError(
                tensor_field(self.name, "byte_size"),
                f"{self.byte_size} bytes declared, but {self.dtype} {list(self.shape)} holds "
                f"{expected}",
            )
        if self.sha256 and (
            len(self.sha256) != 64 or any(c not in "0123456789abcdef" for c in self.sha256)
        ):
            raise StreamError(
                tensor_field(self.name, "sha256"), "must be 64 lower-case hex digits or empty"
            )
        if self.packing is not None:
            if info.codes_per_element == 1:
                raise StreamError(
                    tensor_field(self.name, "packing"), f"{self.dtype} is not a packed dtype"
                )
            if not -len(self.shape) <= self.packing.packed_dim < max(len(self.shape), 1):
                raise StreamError(
                    tensor_field(self.name, "packing.packed_dim"),
                    f"{self.packing.packed_dim} is not a dimension of {list(self.shape)}",
                )
            if self.packing.order not in PACK_ORDERS:
                raise StreamError(
                    tensor_field(self.name, "packing.order"),
                    f"must be one of {PACK_ORDERS}, got {self.packing.order!r}",
                )

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "name": self.name,
            "dtype": self.dtype,
            "shape": list(self.shape),
            "byte_size": self.byte_size,
            "sha256": self.sha256,
        }
        if self.packing is not None:
            out["packing"] = {"packed_dim": self.packing.packed_dim, "order": self.packing.order}
        return out

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> TensorSpec:
        packing = obj.get("packing")
        return cls(
            name=str(obj["name"]),
            dtype=str(obj["dtype"]),
            shape=tuple(int(d) for d in obj["shape"]),
            byte_size=int(obj["byte_size"]),
            sha256=str(obj.get("sha256", "")),
            packing=None
            if not packing
            else Packing(int(packing["packed_dim"]), str(packing.get("order", "sequential"))),
        )


@dataclass
class StreamBudget:
    """The bytes one call may declare in total (the layer, not the stream)."""

    limit: int
    used: int = 0
    setting: str = "convert_max_layer_bytes"

    def reserve(self, spec: TensorSpec) -> None:
        if self.used + spec.byte_size > self.limit:
            raise StreamLimitError(
                tensor_field(spec.name, "byte_size"),
                f"the call's tensors would take {self.used + spec.byte_size} bytes, over the "
                f"server's limit of {self.limit} bytes for one layer (setting {self.setting})",
                self.setting,
            )
        self.used += spec.byte_size


@dataclass
class TensorAssembler:
    """Receives one declared tensor's chunks, in order, into `buffer` (exactly its size).

    The buffer is the caller's: a shared-memory segment the worker maps, so the data is
    written once and never copied again on the way to the converter."""

    spec: TensorSpec
    buffer: memoryview
    received: int = 0
    _digest: Any = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if len(self.buffer) != self.spec.byte_size:
            raise ValueError("the buffer must be exactly the declared size")
        self._digest = hashlib.sha256()

    @property
    def complete(self) -> bool:
        return self.received == self.spec.byte_size

    def feed(self, name: str, offset: int, data: bytes | memoryview) -> None:
        spec = self.spec
        if name != spec.name:
            raise StreamError(
                tensor_field(spec.name, "chunk.name"),
                f"a chunk of {name!r} arrived while {spec.name!r} is incomplete "
                f"({self.received} of {spec.byte_size} bytes)",
            )
        if offset != self.received:
            raise StreamError(
                tensor_field(spec.name, "chunk.offset"),
                f"chunks must arrive in order: expected offset {self.received}, got {offset}",
            )
        end = offset + len(data)
        if end > spec.byte_size:
            raise StreamError(
                tensor_field(spec.name, "chunk.data"),
                f"the stream overruns the declared size: {end} > {spec.byte_size} bytes",
            )
        self.buffer[offset:end] = data
        self._digest.update(data)
        self.received = end

    def finish(self) -> str:
        """Check the tensor is complete and matches its digest; returns the SHA-256."""
        spec = self.spec
        if self.received != spec.byte_size:
            raise StreamError(
                tensor_field(spec.name, "chunk"),
                f"the stream stopped short: {self.received} of {spec.byte_size} bytes",
            )
        digest = str(self._digest.hexdigest())
        if spec.sha256 and digest != spec.sha256:
            raise StreamError(
                tensor_field(spec.name, "sha256"),
                f"checksum mismatch: declared {spec.sha256}, received data hashes to {digest}",
            )
        return digest


def chunks(data: memoryview, max_bytes: int) -> Iterator[tuple[int, memoryview]]:
    """(offset, slice) pairs covering `data` in slices of at most `max_bytes`; an empty
    tensor yields nothing."""
    if max_bytes <= 0:
        raise ValueError("max_bytes must be positive")
    for offset in range(0, len(data), max_bytes):
        yield offset, data[offset : offset + max_bytes]


def sha256_of(data: bytes | memoryview) -> str:
    return hashlib.sha256(data).hexdigest()
