"""A synchronous ConvertWeights client, for `moe-control convert --server` and tests.

`convert_layer_remote` streams one layer's tensors (header, then each tensor's TensorHeader
and chunks, with their SHA-256) and collects the converted tensors and the summary;
`convert_checkpoint_remote` sends a path-mode header and hands each progress message to a
callback. Both raise `grpc.RpcError` as the server answers (never retried: the
request stream is consumed), and `ServerNotReadyError` when asked to wait and it is not.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from service.api.codecs import conversion as convert_codec
from service.api.generated.moe_control.v1 import moe_control_service_pb2 as pb
from service.api.generated.moe_control.v1 import selection_pb2, tensor_pb2
from service.client.channel import Connection
from service.formats.io.streaming import TensorSpec, chunks

DEFAULT_CHUNK = 1024 * 1024


@dataclass
class LayerResult:
    tensors: dict[str, tuple[TensorSpec, bytes]] = field(default_factory=dict)
    summary: pb.ConvertSummary | None = None


def header_for(
    *,
    deployment_json: str | None = None,
    model_config_json: str | None = None,
    backend: str = "",
    platform_preset: str | None = None,
    ruleset: str = "",
    keep_loaded: bool = False,
    return_tensors: bool = True,
    checkpoint: tuple[str, str] | None = None,
    layers: tuple[int, int] | None = None,
    max_chunk_bytes: int = 0,
    worker_index: int | None = None,
) -> pb.ConvertWeightsHeader:
    header = pb.ConvertWeightsHeader(
        target_backend=backend,
        ruleset=ruleset,
        keep_loaded=keep_loaded,
        max_chunk_bytes=max_chunk_bytes,
    )
    if deployment_json is not None:
        header.spec_json = deployment_json
    elif model_config_json is not None:
        header.model_config.CopyFrom(selection_pb2.ModelConfig(config_json=model_config_json))
    if platform_preset:
        header.platform.preset = platform_preset
    if worker_index is not None:
        header.worker_index = worker_index
    if checkpoint is not None:
        header.checkpoint.input_dir, header.checkpoint.output_dir = checkpoint
        if layers is not None:
            header.checkpoint.layers.start, header.checkpoint.layers.end = layers
    else:
        header.inline.return_tensors = return_tensors
    return header


def tensor_requests(
    header: pb.ConvertWeightsHeader,
    tensors: Mapping[str, tuple[TensorSpec, memoryview]],
    chunk_bytes: int = DEFAULT_CHUNK,
) -> Iterator[pb.ConvertWeightsRequest]:
    """The request stream: the header, then each tensor's header and chunks."""
    yield pb.ConvertWeightsRequest(header=header)
    for spec, data in tensors.values():
        digest = spec.sha256 or hashlib.sha256(data).hexdigest()
        declared = TensorSpec(
            spec.name, spec.dtype, spec.shape, spec.byte_size, digest, spec.packing
        )
        yield pb.ConvertWeightsRequest(tensor=convert_codec.tensor_header(declared))
        for offset, part in chunks(data, chunk_bytes):
            yield pb.ConvertWeightsRequest(
                chunk=tensor_pb2.TensorChunk(name=spec.name, offset=offset, data=bytes(part))
            )


def convert_layer_remote(
    connection: Connection,
    header: pb.ConvertWeightsHeader,
    tensors: Mapping[str, tuple[TensorSpec, memoryview]],
    chunk_bytes: int = DEFAULT_CHUNK,
) -> LayerResult:
    result = LayerResult()
    buffers: dict[str, bytearray] = {}
    specs: dict[str, TensorSpec] = {}
    with connection.session() as session:
        responses = session.stream(
            "ConvertWeights", tensor_requests(header, tensors, chunk_bytes)
        )
        for response in responses:
            kind = response.WhichOneof("message")
            if kind == "tensor":
                spec = convert_codec.tensor_spec(response.tensor)
                specs[spec.name] = spec
                buffers[spec.name] = bytearray()
            elif kind == "chunk":
                buffers[response.chunk.name] += response.chunk.data
            elif kind == "summary":
                result.summary = response.summary
    for name, data in buffers.items():
        spec = specs[name]
        if len(data) != spec.byte_size or hashlib.sha256(data).hexdigest() != spec.sha256:
            raise ValueError(f"{name}: the server's data does not match its header")
        result.tensors[name] = (spec, bytes(data))
    return result


def convert_checkpoint_remote(
    connection: Connection,
    header: pb.ConvertWeightsHeader,
    on_progress: Callable[[dict[str, Any]], None] | None = None,
) -> pb.ConvertSummary:
    summary: pb.ConvertSummary | None = None
    with connection.session() as session:
        for response in session.stream(
            "ConvertWeights", [pb.ConvertWeightsRequest(header=header)]
        ):
            kind = response.WhichOneof("message")
            if kind == "progress" and on_progress is not None:
                on_progress(convert_codec.progress_to_json(response.progress))
            elif kind == "summary":
                summary = response.summary
    if summary is None:
        raise ValueError("the server ended the stream without a summary")
    return summary
