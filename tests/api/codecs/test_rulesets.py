"""ListRulesets' codec, the request field through the resolver, and the servicer's answer."""

from __future__ import annotations

import asyncio
import json

import pytest

from service.api.codecs import rulesets as codec
from service.api.codecs import selection as selection_codec
from service.api.generated.moe_control.v1 import moe_control_service_pb2 as pb
from service.api.servicer import SelectionServicer
from service.metrics import Metrics
from service.oracle import DEFAULT_RULESET, PLATFORM_PRESETS, UnknownRulesetError
from service.oracle.releases import RELEASES
from service.oracle.rulesets import listing
from tests.api.test_servicer import GPTQ, LAYER, Platforms, ask


def test_the_response_carries_every_ruleset_and_reads_back_as_the_listing() -> None:
    response = codec.rulesets_response()
    assert [r.name for r in response.rulesets] == list(RELEASES)
    (old,) = [r for r in response.rulesets if r.name == "vllm-0.32"]
    info = response.rulesets[-1]
    assert (old.torch_version, old.humming_kernels_version) == ("2.13.0", "0.1.17")
    assert not old.is_default
    assert (info.name, info.first_version, info.below_version) == ("vllm-0.34", "0.34.0", "0.35")
    assert (info.torch_version, info.humming_kernels_version) == ("2.14.0", "0.1.19")
    assert info.is_default and "HUMMING" in info.backends and "marlin" in info.moe_backends
    wire = pb.ListRulesetsResponse.FromString(response.SerializeToString())
    assert codec.rulesets_from_pb(wire) == listing()


def test_the_servicer_answers_list_rulesets_itself() -> None:
    selection = SelectionServicer(Platforms(None), Metrics())
    assert "ListRulesets" in SelectionServicer.METHODS
    answer = asyncio.run(selection.ListRulesets(pb.ListRulesetsRequest(), None))
    assert codec.rulesets_from_pb(answer) == listing()
    handler = selection.handlers()["ListRulesets"]
    assert handler.request_deserializer is not None
    assert handler.response_serializer(answer) == answer.SerializeToString()


@pytest.mark.parametrize("name", ["0.33", "0.33.0", "v0.33.0", "vllm-0.33", "0.33.2"])
def test_the_request_field_takes_every_spelling(name: str) -> None:
    request = pb.SelectBackendRequest(spec_json="{}", ruleset=name)
    assert selection_codec.select_query(request).ruleset == "vllm-0.33"
    assert selection_codec.select_query(pb.SelectBackendRequest(spec_json="{}")).ruleset == ""


def test_an_unknown_request_field_is_refused_before_anything_is_decided() -> None:
    with pytest.raises(UnknownRulesetError) as caught:
        selection_codec.select_query(pb.SelectBackendRequest(spec_json="{}", ruleset="0.26"))
    (violation,) = caught.value.violations
    assert violation.field == "ruleset"
    assert "vllm-0.33 (vLLM >=0.33.0,<0.34)" in violation.description


@pytest.mark.parametrize(("field", "spec_ruleset"), [("v0.33.0", None), ("", "0.33.1"), ("", None)])
def test_select_backend_decides_by_the_field_else_the_specs_else_the_default(
    field: str, spec_ruleset: str | None
) -> None:
    selection = SelectionServicer(Platforms(PLATFORM_PRESETS["h200"]), Metrics())
    body = {"hf_quantization_config": GPTQ, "layer": LAYER}
    if spec_ruleset is not None:
        body["ruleset"] = spec_ruleset
    data = pb.SelectBackendRequest(spec_json=json.dumps(body), ruleset=field).SerializeToString()
    assert ask(selection, data).ruleset == (
        "vllm-0.33" if field or spec_ruleset else DEFAULT_RULESET
    )
