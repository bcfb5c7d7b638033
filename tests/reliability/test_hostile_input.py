"""Hostile input, property-based, over real loopback gRPC against one real server.

Every request below is malformed or adversarial: random and truncated protobuf bytes,
contradicting shapes and dtypes, byte lengths that do not match shapes, enormous declared
shapes, negative and zero sizes, unknown enum values, NaN and Inf, chunk streams out of
order or duplicated, deeply nested and huge JSON. The server must answer each with a
well-formed status (wire.ALLOWED; INVALID_ARGUMENT names the field), never crash (the
autouse fixture checks it still serves) and never hang (every call has a deadline).

`make test` runs a few hundred cases; MOE_CONTROL_FUZZ_EXAMPLES=10000 (`make fuzz-long`)
runs that many per property.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path
from typing import Any

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from integration.serverproc import ServerProcess

from reliability import wire
from service.api.generated.moe_control.v1 import moe_control_service_pb2 as pb
from service.api.generated.moe_control.v1 import platform_pb2, selection_pb2, tensor_pb2
from service.client.convert import header_for, tensor_requests
from service.formats.io.safetensors import SafetensorsFile
from service.formats.io.streaming import FROM_SAFETENSORS, TensorSpec
from service.formats.synthetic.checkpoints import SyntheticSpec, write_synthetic_checkpoint

SYNTH = SyntheticSpec(num_layers=1, num_experts=2, hidden_size=64, intermediate_size=64)
GPTQ = {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": False, "sym": True}
LAYER = {"num_experts": 8, "top_k": 2, "hidden_size": 256, "intermediate_size": 128}
SPEC = {"hf_quantization_config": GPTQ, "layer": LAYER, "platform": "a100"}

# Each call is a real RPC: no per-example deadline, no database under the repo.
FUZZ = settings(
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


class Layer(dict[str, Any]):
    """The fixture's data, with a short repr (hypothesis prints it with every failure)."""

    def __repr__(self) -> str:
        return "<layer fixture>"


@pytest.fixture(scope="module")
def layer(root: Path) -> dict[str, Any]:
    """A small real checkpoint layer: its config and its expert tensors as stored."""
    write_synthetic_checkpoint(root / "root" / "ckpt", SYNTH)
    tensors: dict[str, tuple[TensorSpec, memoryview]] = {}
    for shard in sorted((root / "root" / "ckpt").glob("*.safetensors")):
        file = SafetensorsFile(shard)
        for name, entry in file.entries.items():
            if ".experts." in name:
                tensors[name] = (
                    TensorSpec.of(name, FROM_SAFETENSORS[entry.dtype], entry.shape),
                    file.raw(name),
                )
    config = (root / "root" / "ckpt" / "config.json").read_text()
    header = header_for(model_config_json=config, backend="TRITON")
    messages = [m.SerializeToString() for m in tensor_requests(header, tensors, 1024)]
    return Layer(config=config, tensors=tensors, messages=messages, header=header)


def _select(**fields: Any) -> bytes:
    return pb.SelectBackendRequest(**fields).SerializeToString()


VALID_UNARY = {
    "SelectBackend": _select(spec_json=json.dumps(SPEC)),
    "RunMoE": pb.RunMoERequest(layer_id="x", backend="TRITON").SerializeToString(),
    "GetPlatform": pb.GetPlatformRequest(worker_index=0).SerializeToString(),
    "ListPlatformPresets": b"",
    "ListRulesets": b"",
    "DiffRulesets": pb.DiffRulesetsRequest(
        spec_json=json.dumps(SPEC), rulesets=["vllm-0.32", "vllm-0.33"]
    ).SerializeToString(),
    "ListWorkers": b"",
    "ListLayers": pb.ListLayersRequest(worker_index=0).SerializeToString(),
    "UnloadLayer": pb.UnloadLayerRequest(layer_id="no-such-layer").SerializeToString(),
}

# grpc itself turned a request it cannot parse into UNKNOWN (aio: "Unexpected DecodeError")
# or INTERNAL (sync: "Exception deserializing request") before any handler ran, for every
# unary method but SelectBackend (which parses its own bytes). Found by this suite; the
# wrappers in interceptors.py now answer INVALID_ARGUMENT naming "request".


@pytest.mark.parametrize("method", wire.UNARY[1:])
def test_undecodable_unary_request_is_invalid_argument(channel: grpc.Channel, method: str) -> None:
    answer = wire.unary(channel, method, b"\xff\xff\xff")
    assert answer.code is grpc.StatusCode.INVALID_ARGUMENT, answer
    assert answer.fields == ["request"], answer


# ---------------------------------------------------------------------------------------
# Random and truncated protobuf bytes


@given(data=st.binary(max_size=512))
@settings(FUZZ, max_examples=wire.examples(60))
def test_random_bytes_select_backend(channel: grpc.Channel, data: bytes) -> None:
    wire.check(wire.unary(channel, "SelectBackend", data), named=False)


@given(method=st.sampled_from(wire.UNARY[1:]), data=st.binary(max_size=512))
@settings(FUZZ, max_examples=wire.examples(40))
def test_random_bytes_other_unary(channel: grpc.Channel, method: str, data: bytes) -> None:
    wire.check(wire.unary(channel, method, data))


@given(
    method=st.sampled_from(
        ("SelectBackend", "UnloadLayer", "ListLayers", "GetPlatform", "DiffRulesets")
    ),
    cut=st.integers(0, 400),
)
@settings(FUZZ, max_examples=wire.examples(40))
def test_truncated_valid_messages(channel: grpc.Channel, method: str, cut: int) -> None:
    data = VALID_UNARY[method]
    answer = wire.unary(channel, method, data[: min(cut, len(data))])
    wire.check(answer, named=method != "SelectBackend")


@given(
    index=st.integers(0, 10_000), junk=st.binary(min_size=1, max_size=64), cut=st.integers(0, 64)
)
@settings(FUZZ, max_examples=wire.examples(40))
def test_convert_stream_of_mangled_messages(
    channel: grpc.Channel, layer: dict[str, Any], index: int, junk: bytes, cut: int
) -> None:
    """The real stream with one message replaced by junk or truncated."""
    messages = list(layer["messages"])
    i = index % len(messages)
    messages[i] = junk if index % 2 else messages[i][:cut]
    wire.check(wire.stream(channel, messages), named=False)


# ---------------------------------------------------------------------------------------
# ConvertWeights: contradicting tensor headers, chunk streams out of order or duplicated

SHAPE_DIM = st.one_of(
    st.integers(-3, 3),
    st.integers(1, 4096),
    st.sampled_from([2**31, 2**32 + 1, 2**40, 2**62, 2**63 - 1, -(2**63)]),
)
DTYPES = st.one_of(st.sampled_from(tensor_pb2.Dtype.values()), st.integers(-4, 200))


@st.composite
def hostile_tensor_header(draw: st.DrawFn, names: list[str]) -> bytes:
    spec_name = draw(st.one_of(st.sampled_from(names), st.text(max_size=40)))
    header = tensor_pb2.TensorHeader(
        name=spec_name,
        dtype=draw(DTYPES),  # type: ignore[arg-type]
        shape=draw(st.lists(SHAPE_DIM, max_size=5)),
        byte_size=draw(st.one_of(st.integers(0, 1 << 20), st.integers(0, 2**64 - 1))),
        sha256=draw(st.sampled_from(["", "0" * 64, "zz", "A" * 64])),
    )
    if draw(st.booleans()):
        header.packing.packed_dim = draw(st.integers(-(2**31), 2**31 - 1))
        header.packing.order = draw(st.integers(-2, 9))  # type: ignore[assignment]
    return pb.ConvertWeightsRequest(tensor=header).SerializeToString()


@given(data=st.data())
@settings(FUZZ, max_examples=wire.examples(60))
def test_contradicting_tensor_headers(
    channel: grpc.Channel, layer: dict[str, Any], data: st.DataObject
) -> None:
    names = list(layer["tensors"])
    messages = [layer["messages"][0]]
    for _ in range(data.draw(st.integers(1, 4))):
        messages.append(data.draw(hostile_tensor_header(names)))
        for _ in range(data.draw(st.integers(0, 3))):
            chunk = tensor_pb2.TensorChunk(
                name=data.draw(st.sampled_from(names)),
                offset=data.draw(st.one_of(st.integers(0, 4096), st.integers(0, 2**64 - 1))),
                data=data.draw(st.binary(max_size=2048)),
            )
            messages.append(pb.ConvertWeightsRequest(chunk=chunk).SerializeToString())
    wire.check(wire.stream(channel, messages))


@given(data=st.data())
@settings(FUZZ, max_examples=wire.examples(40))
def test_chunks_reordered_duplicated_or_dropped(
    channel: grpc.Channel, layer: dict[str, Any], data: st.DataObject
) -> None:
    """The real stream, its messages after the header permuted, repeated or dropped."""
    head, rest = layer["messages"][0], layer["messages"][1:]
    picks = data.draw(st.lists(st.integers(0, len(rest) - 1), min_size=0, max_size=len(rest) + 4))
    body = [rest[i] for i in picks]
    if body == rest:
        body = body[1:]
    wire.check(wire.stream(channel, [head, *body]))


def test_enormous_declared_shapes_are_refused_before_allocation(
    channel: grpc.Channel, server: ServerProcess, layer: dict[str, Any]
) -> None:
    """Declared sizes up to 2**63 bytes: refused from the header, RSS does not move."""
    name = next(iter(layer["tensors"]))
    before = wire.tree_rss_bytes(server.process.pid)
    for shape, dtype in [
        ([2**31, 2**31], tensor_pb2.DTYPE_INT32),
        ([2**40], tensor_pb2.DTYPE_UINT8),
        ([2**20, 2**20, 2**20], tensor_pb2.DTYPE_FLOAT32),
        ([1 << 33], tensor_pb2.DTYPE_BFLOAT16),
        ([2**62, 2], tensor_pb2.DTYPE_INT64),
    ]:
        size = math.prod(shape) * 8
        tensor = tensor_pb2.TensorHeader(
            name=name, dtype=dtype, shape=shape, byte_size=min(size, 2**64 - 1)
        )
        messages = [
            layer["messages"][0],
            pb.ConvertWeightsRequest(tensor=tensor).SerializeToString(),
        ]
        answer = wire.stream(channel, messages)
        assert answer.code in (
            grpc.StatusCode.INVALID_ARGUMENT,
            grpc.StatusCode.RESOURCE_EXHAUSTED,
        ), answer
        wire.check(answer)
    grown = wire.tree_rss_bytes(server.process.pid) - before
    assert grown < 64 * 1024 * 1024, f"server memory grew by {grown / 2**20:.0f} MiB"


@given(
    value=st.sampled_from([math.nan, math.inf, -math.inf]),
    index=st.integers(0, 10_000),
)
# Each example is a whole conversion and the space is small (3 values x a few tensors).
@settings(FUZZ, max_examples=min(wire.examples(12), 60))
def test_nan_and_inf_in_tensor_data(
    channel: grpc.Channel, layer: dict[str, Any], value: float, index: int
) -> None:
    """Scales full of NaN/Inf: converting them is allowed (OK), a crash is not."""
    tensors = dict(layer["tensors"])
    floats = [n for n, (s, _) in tensors.items() if s.dtype in ("float16", "bfloat16", "float32")]
    name = floats[index % len(floats)]
    spec, raw = tensors[name]
    half = struct.pack("<e", value)
    tensors[name] = (
        TensorSpec.of(name, spec.dtype, spec.shape),
        memoryview(half * (len(raw) // 2)),
    )
    messages = [m.SerializeToString() for m in tensor_requests(layer["header"], tensors, 1024)]
    wire.check(wire.stream(channel, messages))


# ---------------------------------------------------------------------------------------
# JSON in the deployment and quantization config; unknown enum values


def _nested(depth: int, kind: str) -> str:
    if kind == "list":
        return "[" * depth + "]" * depth
    return '{"a":' * depth + "1" + "}" * depth


JSON_TEXT = st.one_of(
    st.builds(_nested, st.integers(1, 200_000), st.sampled_from(["list", "object"])),
    st.builds(
        lambda n: json.dumps({"quant_method": "gptq", "x": "y" * n}), st.integers(0, 4 << 20)
    ),
    st.sampled_from(["NaN", "Infinity", "-Infinity", "null", "1e999", '"s"', "{", "", "\x00"]),
    st.text(max_size=200),
)
NUMBERS = st.sampled_from([math.nan, math.inf, -math.inf, -1, 0, 2**63, -(2**63), 1e308, 3.5])


@given(
    text=JSON_TEXT, where=st.sampled_from(["spec_json", "hf_config_json", "config_json", "header"])
)
@settings(FUZZ, max_examples=wire.examples(40))
def test_nested_and_huge_json(channel: grpc.Channel, text: str, where: str) -> None:
    if where == "spec_json":
        answer = wire.unary(channel, "SelectBackend", _select(spec_json=text))
    elif where == "hf_config_json":
        spec = selection_pb2.DeploymentSpec(
            quantization_config=selection_pb2.QuantizationConfig(hf_config_json=text),
            layer=selection_pb2.MoeLayer(**LAYER),
        )
        answer = wire.unary(channel, "SelectBackend", _select(spec=spec))
    elif where == "config_json":
        answer = wire.unary(
            channel,
            "SelectBackend",
            _select(model_config=selection_pb2.ModelConfig(config_json=text)),
        )
    else:
        header = pb.ConvertWeightsHeader(spec_json=text, inline=pb.InlineConversion())
        answer = wire.stream(channel, [pb.ConvertWeightsRequest(header=header).SerializeToString()])
    wire.check(answer)


@given(
    key=st.sampled_from(
        ["bits", "group_size", "num_experts", "top_k", "hidden_size", "intermediate_size"]
    ),
    value=NUMBERS,
)
@settings(FUZZ, max_examples=wire.examples(30))
def test_nan_inf_and_out_of_range_numbers_in_spec(
    channel: grpc.Channel, key: str, value: float
) -> None:
    spec = json.loads(json.dumps(SPEC))
    target = spec["hf_quantization_config"] if key in GPTQ else spec["layer"]
    target[key] = value
    wire.check(wire.unary(channel, "SelectBackend", _select(spec_json=json.dumps(spec))))


ENUM_AND_SIZE_FIELDS = st.fixed_dictionaries(
    {
        "method": st.integers(-3, 1000),
        "bits": st.integers(0, 2**32 - 1),
        "group": st.integers(-(2**31), 2**31 - 1),
        "act": st.integers(-3, 1000),
        "device": st.integers(-3, 1000),
        "major": st.integers(0, 2**32 - 1),
        "experts": st.integers(0, 2**32 - 1),
        "hidden": st.integers(0, 2**64 - 1),
    }
)


@given(v=ENUM_AND_SIZE_FIELDS)
@settings(FUZZ, max_examples=wire.examples(40))
def test_unknown_enums_and_extreme_sizes(channel: grpc.Channel, v: dict[str, int]) -> None:
    spec = selection_pb2.DeploymentSpec(
        quantization_config=selection_pb2.QuantizationConfig(
            explicit=selection_pb2.ExplicitQuantization(
                method=v["method"],  # type: ignore[arg-type]
                bits=v["bits"],
                group_size=v["group"],
                act_order=v["act"],  # type: ignore[arg-type]
            )
        ),
        layer=selection_pb2.MoeLayer(
            num_experts=v["experts"],
            top_k=2,
            hidden_size=v["hidden"],
            intermediate_size=v["hidden"],
        ),
    )
    platform = selection_pb2.PlatformSelector(
        profile=platform_pb2.PlatformProfile(
            device=v["device"],  # type: ignore[arg-type]
            capability=platform_pb2.ComputeCapability(major=v["major"], minor=v["major"]),
        )
    )
    wire.check(wire.unary(channel, "SelectBackend", _select(spec=spec, platform=platform)))


@given(worker=st.integers(0, 2**32 - 1), layer_id=st.text(max_size=300))
@settings(FUZZ, max_examples=wire.examples(30))
def test_worker_and_layer_rpcs(channel: grpc.Channel, worker: int, layer_id: str) -> None:
    for method, data in [
        ("GetPlatform", pb.GetPlatformRequest(worker_index=worker)),
        ("ListLayers", pb.ListLayersRequest(worker_index=worker)),
        ("UnloadLayer", pb.UnloadLayerRequest(layer_id=layer_id)),
        (
            "RunMoE",
            pb.RunMoERequest(layer_id=layer_id, worker_index=worker, timed_iterations=worker),
        ),
    ]:
        wire.check(wire.unary(channel, method, data.SerializeToString()))
