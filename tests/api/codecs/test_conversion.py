"""ConvertWeights' request stream as the data plane reads it: the header first, then the
tensors' declarations and chunks; anything else is an input error naming the field."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from service.api.codecs import conversion
from service.api.generated.moe_control.v1 import moe_control_service_pb2 as pb
from service.api.generated.moe_control.v1 import tensor_pb2
from service.dataplane.convert import ChunkReceived, StrayHeader, TensorDeclared
from service.formats.errors import ConvertInputError


async def stream(*messages: pb.ConvertWeightsRequest) -> AsyncIterator[pb.ConvertWeightsRequest]:
    for message in messages:
        yield message


def read(*messages: pb.ConvertWeightsRequest) -> tuple[object, list[object]]:
    async def go() -> tuple[object, list[object]]:
        header, items = await conversion.convert_call(stream(*messages))
        return header, [item async for item in items]

    return asyncio.run(go())


def test_header_then_items() -> None:
    header = pb.ConvertWeightsHeader(spec_json="{}", target_backend="MARLIN", worker_index=1)
    tensor = tensor_pb2.TensorHeader(name="w13_qweight", dtype=tensor_pb2.DTYPE_INT32, shape=[2, 4])
    chunk = tensor_pb2.TensorChunk(name="w13_qweight", offset=0, data=b"x" * 32)
    got, items = read(
        pb.ConvertWeightsRequest(header=header),
        pb.ConvertWeightsRequest(tensor=tensor),
        pb.ConvertWeightsRequest(chunk=chunk),
        pb.ConvertWeightsRequest(header=header),
    )
    assert got.target_backend == "MARLIN" and got.worker_index == 1  # type: ignore[attr-defined]
    assert got.checkpoint is None and got.return_tensors  # type: ignore[attr-defined]
    assert got.deployment() == {}  # type: ignore[attr-defined]
    declared, received, stray = items
    assert isinstance(declared, TensorDeclared) and declared.spec.byte_size == 32
    assert received == ChunkReceived("w13_qweight", 0, b"x" * 32)
    assert isinstance(stray, StrayHeader)


def test_the_first_message_must_be_the_header() -> None:
    with pytest.raises(ConvertInputError) as caught:
        read(pb.ConvertWeightsRequest(chunk=tensor_pb2.TensorChunk(name="x")))
    assert caught.value.field == "header"
    with pytest.raises(ConvertInputError):
        read()


def test_path_mode_header() -> None:
    header = pb.ConvertWeightsHeader()
    header.checkpoint.input_dir = "model"
    header.checkpoint.output_dir = "out"
    header.checkpoint.layers.start, header.checkpoint.layers.end = 2, 5
    got = conversion.convert_header(header)
    assert got.checkpoint is not None and got.checkpoint.layers == (2, 5)
    assert not got.names_deployment and got.worker_index is None
