"""Chunk assembly: declared sizes, order, overrun, short streams, checksums, budgets."""

from __future__ import annotations

import hashlib

import pytest

from service.formats.errors import StreamError
from service.formats.io.streaming import Packing, StreamBudget, TensorAssembler, TensorSpec, chunks

NAME = "w13_qweight"


def spec(data: bytes, *, sha: bool = True, shape: tuple[int, ...] | None = None) -> TensorSpec:
    return TensorSpec.of(
        NAME,
        "int32",
        shape or (len(data) // 4,),
        sha256=hashlib.sha256(data).hexdigest() if sha else "",
    )


def assemble(data: bytes, pieces: int) -> TensorAssembler:
    s = spec(data)
    assembler = TensorAssembler(s, memoryview(bytearray(s.byte_size)))
    for offset, part in chunks(memoryview(data), max(1, len(data) // pieces)):
        assembler.feed(NAME, offset, part)
    return assembler


def test_chunks_reassemble_exactly() -> None:
    data = bytes(range(256)) * 17
    assembler = assemble(data, 7)
    assert assembler.finish() == hashlib.sha256(data).hexdigest()
    assert bytes(assembler.buffer) == data


def test_chunking_covers_everything_in_bounded_pieces() -> None:
    data = memoryview(bytes(1000))
    pieces = list(chunks(data, 300))
    assert [o for o, _ in pieces] == [0, 300, 600, 900]
    assert max(len(p) for _, p in pieces) == 300
    assert list(chunks(memoryview(b""), 10)) == []
    with pytest.raises(ValueError):
        list(chunks(data, 0))


def field_of(error: pytest.ExceptionInfo[StreamError]) -> str:
    return error.value.field


def test_overrun_names_the_tensor() -> None:
    data = bytes(64)
    s = spec(data)
    assembler = TensorAssembler(s, memoryview(bytearray(64)))
    assembler.feed(NAME, 0, data[:60])
    with pytest.raises(StreamError) as info:
        assembler.feed(NAME, 60, bytes(8))
    assert field_of(info) == f"tensors[{NAME}].chunk.data"
    assert "overruns" in str(info.value)


def test_short_stream_and_out_of_order_chunks() -> None:
    data = bytes(64)
    assembler = TensorAssembler(spec(data), memoryview(bytearray(64)))
    with pytest.raises(StreamError) as info:
        assembler.feed(NAME, 8, data[:8])
    assert field_of(info) == f"tensors[{NAME}].chunk.offset"
    assembler.feed(NAME, 0, data[:8])
    with pytest.raises(StreamError) as info:
        assembler.finish()
    assert "stopped short: 8 of 64" in str(info.value)
    with pytest.raises(StreamError) as info:
        assembler.feed("other", 8, data[:8])
    assert field_of(info) == f"tensors[{NAME}].chunk.name"


def test_checksum_mismatch() -> None:
    data = bytes(range(64))
    s = TensorSpec.of(NAME, "uint8", (64,), sha256=hashlib.sha256(b"x").hexdigest())
    assembler = TensorAssembler(s, memoryview(bytearray(64)))
    assembler.feed(NAME, 0, data)
    with pytest.raises(StreamError) as info:
        assembler.finish()
    assert field_of(info) == f"tensors[{NAME}].sha256"


@pytest.mark.parametrize(
    ("declared", "field", "match"),
    [
        (TensorSpec(NAME, "int32", (4, 4), 60), "byte_size", "holds 64"),
        (TensorSpec(NAME, "complex64", (4,), 32), "dtype", "unknown"),
        (TensorSpec(NAME, "int32", (-1,), 0), "shape", "negative"),
        (TensorSpec(NAME, "int32", (1,), 4, sha256="ABC"), "sha256", "hex"),
        (TensorSpec.of(NAME, "int32", (2,), packing=Packing(0)), "packing", "not a packed"),
        (
            TensorSpec.of(NAME, "uint4_packed_int32", (2, 2), packing=Packing(2)),
            "packing.packed_dim",
            "not a dimension",
        ),
        (
            TensorSpec.of(NAME, "uint4_packed_int32", (2, 2), packing=Packing(0, "zigzag")),
            "packing.order",
            "one of",
        ),
    ],
)
def test_bad_declarations(declared: TensorSpec, field: str, match: str) -> None:
    with pytest.raises(StreamError, match=match) as info:
        declared.validate()
    assert field_of(info) == f"tensors[{NAME}].{field}"


def test_nameless_tensor() -> None:
    with pytest.raises(StreamError) as info:
        TensorSpec.of("", "int32", (1,)).validate()
    assert field_of(info) == "tensors[].name"


def test_budget_bounds_the_layer_not_the_stream() -> None:
    budget = StreamBudget(100)
    budget.reserve(TensorSpec.of("a", "uint8", (60,)))
    with pytest.raises(StreamError) as info:
        budget.reserve(TensorSpec.of("b", "uint8", (41,)))
    assert field_of(info) == "tensors[b].byte_size"
    budget.reserve(TensorSpec.of("c", "uint8", (40,)))


def test_spec_json_round_trip() -> None:
    s = TensorSpec.of("q", "uint4_packed_int32", (2, 3), sha256="0" * 64, packing=Packing(0, "awq"))
    s.validate()
    assert TensorSpec.from_json(s.to_json()) == s
