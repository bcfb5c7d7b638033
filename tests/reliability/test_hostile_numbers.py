"""Hostile numbers through every door that takes JSON, property-based, one real server.

A number is placed, as raw JSON text, at a numeric position of a deployment spec or a
config.json: integers of thousands of digits (beyond Python's int-string limit), integers
beyond 64 bits, `NaN`, `Infinity`, overflowing exponents, floats where integers belong,
negative, zero and absurd sizes, and ordinary numbers. The same text goes through gRPC
(SelectBackend `spec_json` and `model_config.config_json`, DiffRulesets, SelectMatrix,
a ConvertWeights header) and HTTP (POST /v1/select, /v1/diff, /v1/select:matrix). No answer
is INTERNAL or 500; a number no JSON consumer can hold is INVALID_ARGUMENT / 400 naming
its path; the server keeps serving. MOE_CONTROL_FUZZ_EXAMPLES scales the properties as in
test_hostile_input.py.
"""

from __future__ import annotations

import http.client
import json
import socket
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from integration.serverproc import ServerProcess, health_status, launch, wait_ready

from reliability import wire
from service.api.generated.moe_control.v1 import moe_control_service_pb2 as pb
from service.api.generated.moe_control.v1 import selection_pb2

FUZZ = settings(
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
GPTQ = {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": False, "sym": True}
LAYER = {"num_experts": 8, "top_k": 2, "hidden_size": 256, "intermediate_size": 128}
SPEC = {
    "hf_quantization_config": GPTQ,
    "layer": {**LAYER, "routing": {"routed_scaling_factor": 1.0}},
    "parallel": {"tensor_parallel_size": 1, "data_parallel_size": 1},
    "platform": {"preset": "a100", "capability": 8.0},
}
CONFIG = {
    "model_type": "deepseek_v3",
    "hidden_size": 256,
    "moe_intermediate_size": 128,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "first_k_dense_replace": 1,
    "n_group": 1,
    "routed_scaling_factor": 2.5,
    "vocab_size": 1000,
    "quantization_config": GPTQ,
}
SPEC_NUMBERS = (
    ("layer", "num_experts"),
    ("layer", "top_k"),
    ("layer", "hidden_size"),
    ("layer", "intermediate_size"),
    ("layer", "routing", "routed_scaling_factor"),
    ("hf_quantization_config", "bits"),
    ("hf_quantization_config", "group_size"),
    ("parallel", "tensor_parallel_size"),
    ("parallel", "data_parallel_size"),
    ("platform", "capability"),
)
CONFIG_NUMBERS = (
    ("n_routed_experts",),
    ("num_experts_per_tok",),
    ("hidden_size",),
    ("moe_intermediate_size",),
    ("first_k_dense_replace",),
    ("n_group",),
    ("routed_scaling_factor",),
    ("vocab_size",),  # read by nothing: still not a number Python may choke on
    ("quantization_config", "group_size"),
)
#: Tokens no JSON consumer of the service can hold: refused where the text is parsed.
REFUSED = st.one_of(
    st.integers(20, 20_000).map(lambda n: "9" * n),
    st.integers(20, 6_000).map(lambda n: "-" + "1" * n),
    st.sampled_from(
        [
            "NaN",
            "Infinity",
            "-Infinity",
            "1e999",
            "-1e999",
            str(2**63),
            str(-(2**63) - 1),
            "1" + "0" * 400 + ".5",
        ]
    ),
)
#: Tokens that parse: whether they are valid is the spec's business, never INTERNAL's.
PARSED = st.one_of(
    st.sampled_from(["-1", "0", "8.5", "4.0", "1e300", "-0.0", str(10**12), str(2**31)]),
    st.integers(-(2**63), 2**63 - 1).map(str),
    st.floats(allow_nan=False, allow_infinity=False).map(repr),
)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture(scope="module")
def doors() -> Iterator[ServerProcess]:
    """One server answering on both doors."""
    process = launch("--http-port", str(_free_port()))
    wait_ready(process)
    yield process
    alive = process.process.poll() is None
    process.stop()
    assert alive, "the server died:\n" + "".join(process.stderr_lines[-40:])


@pytest.fixture(scope="module")
def grpc_door(doors: ServerProcess) -> Iterator[grpc.Channel]:
    with doors.channel() as channel:
        yield channel


@pytest.fixture(autouse=True)
def still_serving(doors: ServerProcess) -> Iterator[None]:
    yield
    assert doors.process.poll() is None, "".join(doors.stderr_lines[-40:])
    with doors.channel() as channel:
        assert health_status(channel) == "SERVING"


def _text(base: dict[str, Any], path: tuple[str, ...], token: str) -> str:
    """`base` as JSON text with the value at `path` replaced by the raw token."""
    value = json.loads(json.dumps(base))
    target = value
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = "@@number@@"
    return json.dumps(value).replace('"@@number@@"', token)


def _post(door: ServerProcess, route: str, body: str) -> tuple[int, dict[str, Any]]:
    assert door.http_url is not None
    where = urlsplit(door.http_url)
    connection = http.client.HTTPConnection(where.hostname, where.port, timeout=wire.DEADLINE_S)
    try:
        connection.request("POST", route, body=body.encode())
        response = connection.getresponse()
        data = response.read()
    finally:
        connection.close()
    answer: dict[str, Any] = json.loads(data)
    return response.status, answer


def _http_fields(answer: dict[str, Any]) -> list[str]:
    return [
        v["field"]
        for d in answer.get("error", {}).get("details", [])
        if d["@type"].endswith("google.rpc.BadRequest")
        for v in d["field_violations"]
    ]


def _grpc_answers(channel: grpc.Channel, spec: str, config: str) -> list[tuple[str, wire.Answer]]:
    """The spec text through each gRPC method that takes a spec, the config text through
    SelectBackend's model_config: (the request field the text sits in, the answer)."""
    model = selection_pb2.ModelConfig(config_json=config)
    header = pb.ConvertWeightsHeader(spec_json=spec, inline=pb.InlineConversion())
    diff = pb.DiffRulesetsRequest(spec_json=spec, rulesets=["vllm-0.32", "vllm-0.33"])
    matrix = pb.SelectMatrixRequest(
        models=[pb.MatrixModel(label="m", spec_json=spec)], gpus=["a100"]
    )
    unary = [
        ("spec_json", "SelectBackend", pb.SelectBackendRequest(spec_json=spec)),
        ("model_config.config_json", "SelectBackend", pb.SelectBackendRequest(model_config=model)),
        ("spec_json", "DiffRulesets", diff),
        ("models[0].spec_json", "SelectMatrix", matrix),
    ]
    answers = [
        (field, wire.unary(channel, method, message.SerializeToString()))
        for field, method, message in unary
    ]
    stream = [pb.ConvertWeightsRequest(header=header).SerializeToString()]
    # the stream names a header field from the header, as its other errors do
    answers.append(("spec_json", wire.stream(channel, stream)))
    return answers


def _http_answers(door: ServerProcess, spec: str, config: str) -> list[tuple[str, int, Any]]:
    """The same texts through the HTTP door: (the field the text sits in, status, answer)."""
    diff = f'{{"from": "vllm-0.32", "to": "vllm-0.33", "deployment": {spec}}}'
    matrix = f'{{"configs": [{{"name": "m", "config": {config}}}], "gpus": ["a100"]}}'
    return [
        (field, *_post(door, route, body))
        for field, route, body in (
            ("body", "/v1/select", spec),
            ("body.config", "/v1/select", f'{{"config": {config}, "platform": "a100"}}'),
            ("body.deployment", "/v1/diff", diff),
            ("body.configs[0].config", "/v1/select:matrix", matrix),
        )
    ]


def _everywhere(
    channel: grpc.Channel, door: ServerProcess, path: tuple[str, ...], token: str, *, refused: bool
) -> None:
    """`token` at `path` of the spec (or, for a config.json key, of the config) through
    every door: never INTERNAL / 500; `refused`: INVALID_ARGUMENT / 400 naming the path
    where the request carries it."""
    in_config = path in CONFIG_NUMBERS
    spec = json.dumps(SPEC) if in_config else _text(SPEC, path, token)
    config = _text(CONFIG, path, token) if in_config else json.dumps(CONFIG)
    dotted = ".".join(path)
    for field, answer in _grpc_answers(channel, spec, config):
        wire.check(answer)
        if refused and (field == "model_config.config_json") == in_config:
            assert answer.code is grpc.StatusCode.INVALID_ARGUMENT, (field, answer)
            assert f"{field}.{dotted}" in answer.fields, (field, answer)
    for field, status, answer in _http_answers(door, spec, config):
        assert status in (200, 400), (field, status, answer)
        if refused and field.endswith("config") == in_config:
            assert status == 400, (field, answer)
            assert f"{field}.{dotted}" in _http_fields(answer), (field, answer)


@given(path=st.sampled_from(SPEC_NUMBERS + CONFIG_NUMBERS), token=REFUSED)
@settings(FUZZ, max_examples=wire.examples(30))
def test_numbers_beyond_any_size_are_refused_naming_the_field(
    grpc_door: grpc.Channel, doors: ServerProcess, path: tuple[str, ...], token: str
) -> None:
    _everywhere(grpc_door, doors, path, token, refused=True)


@given(path=st.sampled_from(SPEC_NUMBERS + CONFIG_NUMBERS), token=PARSED)
@settings(FUZZ, max_examples=wire.examples(30))
def test_other_numbers_are_decided_or_refused_never_internal(
    grpc_door: grpc.Channel, doors: ServerProcess, path: tuple[str, ...], token: str
) -> None:
    _everywhere(grpc_door, doors, path, token, refused=False)
