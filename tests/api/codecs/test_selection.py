"""pb <-> domain conversions."""

from __future__ import annotations

import json

import pytest
from google.protobuf import struct_pb2

from service.api.codecs import selection as codec
from service.api.generated.moe_control.v1 import moe_control_service_pb2 as pb
from service.api.generated.moe_control.v1 import platform_pb2, selection_pb2
from service.oracle import (
    DEFAULT_RULESET,
    PLATFORM_PRESETS,
    InvalidSpecError,
    PlatformProfile,
    SelectionError,
    parse_deployment,
    select,
)

LAYER = {"num_experts": 64, "top_k": 6, "hidden_size": 2048, "intermediate_size": 1408}
GPTQ = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True}


def test_struct_numbers_come_back_as_ints() -> None:
    struct = struct_pb2.Struct()
    struct.update({"bits": 4, "group_size": -1, "damp": 0.01, "nested": {"n": [1, 2.5]}})
    assert codec.struct_to_json(struct) == {
        "bits": 4,
        "group_size": -1,
        "damp": 0.01,
        "nested": {"n": [1, 2.5]},
    }
    assert isinstance(codec.struct_to_json(struct)["bits"], int)


def test_typed_spec_leaves_absent_fields_to_the_oracle_defaults() -> None:
    typed = selection_pb2.DeploymentSpec(
        quantization_config=selection_pb2.QuantizationConfig(hf_config_json=json.dumps(GPTQ)),
        layer=selection_pb2.MoeLayer(
            **LAYER,
            has_bias=False,
            routing=selection_pb2.RoutingConfig(scoring_func="sigmoid", renormalize=False),
        ),
        parallel=selection_pb2.ParallelConfig(tensor_parallel_size=2),
        moe_backend="marlin",
    )
    assert codec.spec_to_json(typed) == {
        "hf_quantization_config": GPTQ,
        "layer": {
            **LAYER,
            "has_bias": False,
            "routing": {"scoring_func": "sigmoid", "renormalize": False},
        },
        "parallel": {"tensor_parallel_size": 2},
        "moe_backend": "marlin",
    }


@pytest.mark.parametrize("method", ["GPTQ", "AWQ", "COMPRESSED_TENSORS"])
def test_explicit_quantization_is_a_config_the_oracle_accepts(method: str) -> None:
    explicit = selection_pb2.ExplicitQuantization(
        method=getattr(selection_pb2, f"QUANT_METHOD_{method}"), bits=4, group_size=128
    )
    hf = codec.explicit_quantization_to_hf(explicit)
    decision = select({"hf_quantization_config": hf, "layer": LAYER, "platform": "a100"})
    assert decision.backend == "MARLIN"


def test_explicit_quantization_needs_a_method() -> None:
    with pytest.raises(InvalidSpecError) as caught:
        codec.explicit_quantization_to_hf(selection_pb2.ExplicitQuantization(bits=4))
    assert caught.value.violations[0].field.endswith("explicit.method")


@pytest.mark.parametrize("name", sorted(PLATFORM_PRESETS))
def test_platform_profiles_round_trip(name: str) -> None:
    profile = PLATFORM_PRESETS[name]
    message = codec.platform_to_pb(profile)
    assert PlatformProfile.from_json(codec.platform_to_json(message)) == profile


def test_unset_packages_mean_the_default_set_and_empty_means_none() -> None:
    base = platform_pb2.PlatformProfile(
        device=platform_pb2.DEVICE_KIND_CUDA,
        capability=platform_pb2.ComputeCapability(major=9, minor=0),
    )
    assert "packages" not in codec.platform_to_json(base)
    none = platform_pb2.PlatformProfile()
    none.CopyFrom(base)
    none.packages.SetInParent()
    assert codec.platform_to_json(none)["packages"] == []


def test_platform_selector_forms() -> None:
    h100 = PLATFORM_PRESETS["h100"]
    assert codec.platform_choice(selection_pb2.PlatformSelector()) is None
    named = codec.platform_choice(selection_pb2.PlatformSelector(preset="h100"))
    assert named is not None and named.resolve(lambda i: h100) == "h100"
    by_worker = codec.platform_choice(selection_pb2.PlatformSelector(worker_index=0))
    assert by_worker is not None and by_worker.resolve(lambda i: h100) == h100.to_json()
    profile = codec.platform_to_pb(h100)
    by_profile = codec.platform_choice(selection_pb2.PlatformSelector(profile=profile))
    assert by_profile is not None and by_profile.profile == codec.platform_to_json(profile)


@pytest.mark.parametrize("preset", ["a100", "h200", "mi300x", "b200", "t4"])
def test_response_json_equals_the_decisions(preset: str) -> None:
    deployment = parse_deployment(
        {"hf_quantization_config": GPTQ, "layer": LAYER, "platform": preset}
    )
    decision = select(deployment)
    response = codec.select_response(decision, deployment.platform, None)
    wire = pb.SelectBackendResponse.FromString(response.SerializeToString())
    assert codec.select_response_to_json(wire) == decision.to_json()
    assert not wire.HasField("server_platform")


def test_selection_failure_round_trips() -> None:
    spec = {"hf_quantization_config": GPTQ, "layer": LAYER, "platform": "h100"}
    with pytest.raises(SelectionError) as caught:
        select({**spec, "moe_backend": "flashinfer_trtllm"})
    message = codec.selection_failure_to_pb(caught.value)
    wire = selection_pb2.SelectionFailure.FromString(message.SerializeToString())
    assert codec.selection_error_from_pb(wire).to_json() == caught.value.to_json()


@pytest.mark.parametrize(
    ("request_", "field"),
    [
        (pb.SelectBackendRequest(), "deployment"),
        (pb.SelectBackendRequest(spec_json="[1]"), "spec_json"),
        (
            pb.SelectBackendRequest(model_config=selection_pb2.ModelConfig()),
            "model_config",
        ),
    ],
)
def test_deployment_errors_name_the_request_field(
    request_: pb.SelectBackendRequest, field: str
) -> None:
    with pytest.raises(InvalidSpecError) as caught:
        codec.deployment_to_json(request_)
    assert caught.value.violations[0].field == field


def test_explanations_platform_and_hints_survive_the_wire() -> None:
    deployment = parse_deployment(
        {
            "hf_quantization_config": GPTQ,
            "layer": LAYER,
            "platform": {"preset": "h200", "packages": []},
        }
    )
    decision = select(deployment, what_would_change=True)
    response = codec.select_response(decision, deployment.platform, None)
    wire = pb.SelectBackendResponse.FromString(response.SerializeToString())
    assert wire.platform.preset == "h200"
    assert wire.HasField("what_would_change")
    humming = next(c for c in wire.candidates if c.backend == "HUMMING")
    assert humming.reason == "kernel does not support current device cuda"
    assert "not installed" in humming.explanation
    as_json = codec.select_response_to_json(wire)
    assert as_json == decision.to_json()
    assert as_json["what_would_change"][0]["changes"][0]["text"] == "install humming-kernels"


def test_hints_are_absent_unless_asked_for() -> None:
    deployment = parse_deployment(
        {"hf_quantization_config": GPTQ, "layer": LAYER, "platform": "a100"}
    )
    wire = codec.select_response(select(deployment), deployment.platform, None)
    assert not wire.HasField("what_would_change")
    assert codec.select_response_to_json(wire)["what_would_change"] is None
    request = pb.SelectBackendRequest(spec_json="{}", what_would_change=True)
    assert codec.select_query(request).what_would_change is True
    assert codec.select_query(pb.SelectBackendRequest(spec_json="{}")).what_would_change is False


def test_a_failure_carries_its_platform_ruleset_and_hints_over_the_wire() -> None:
    spec = {"hf_quantization_config": GPTQ, "layer": LAYER, "platform": "cpu-noamx"}
    with pytest.raises(SelectionError) as caught:
        select(spec, what_would_change=True)
    wire = selection_pb2.SelectionFailure.FromString(
        codec.selection_failure_to_pb(caught.value).SerializeToString()
    )
    assert (wire.ruleset, wire.platform.preset) == (DEFAULT_RULESET, "cpu-noamx")
    assert wire.what_would_change.hints
    assert codec.selection_error_from_pb(wire).to_json() == caught.value.to_json()
