"""DiffRulesets' codec: a request as the data plane's query (each deployment form), a
diff as the response and back, so that a remote `moe-control diff` prints what a local one
prints, decisions and failures alike."""

from __future__ import annotations

import json
from typing import Any

import pytest

from service.api.codecs import upgrade as codec
from service.api.generated.moe_control.v1 import moe_control_service_pb2 as pb
from service.api.generated.moe_control.v1 import selection_pb2
from service.oracle import InvalidSpecError
from service.oracle.gate import DEFAULT_FAIL_ON
from service.oracle.upgrade import diff_rulesets, upgrade

GPTQ = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True}
LAYER = {
    "num_experts": 8,
    "top_k": 2,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "activation": "gelu_tanh",
}
SPEC: dict[str, Any] = {"hf_quantization_config": GPTQ, "layer": LAYER, "platform": "cpu"}


def test_a_request_becomes_the_query() -> None:
    request = pb.DiffRulesetsRequest(
        spec_json=json.dumps(SPEC),
        rulesets=["0.32", "vllm-0.33"],
        platform=selection_pb2.PlatformSelector(preset="h200"),
    )
    query = codec.diff_query(request)
    assert query.spec == SPEC and query.rulesets == ("0.32", "vllm-0.33")
    assert query.platform is not None and query.platform.preset == "h200"
    assert query.fail_on == ("backend", "experts_class", "failure")  # none named: the default
    request.fail_on.extend(["verdict", "backend"])
    assert codec.diff_query(request).fail_on == ("backend", "verdict")


def test_an_unknown_fail_on_field_names_the_field() -> None:
    request = pb.DiffRulesetsRequest(
        spec_json=json.dumps(SPEC), rulesets=["0.32", "0.33"], fail_on=["stage"]
    )
    with pytest.raises(InvalidSpecError) as caught:
        codec.diff_query(request)
    (violation,) = caught.value.violations
    assert violation.field == "fail_on" and "accepted: backend, " in violation.description


def test_a_request_without_a_deployment_names_the_field() -> None:
    with pytest.raises(InvalidSpecError) as caught:
        codec.diff_query(pb.DiffRulesetsRequest(rulesets=["0.32", "0.33"]))
    assert caught.value.violations[0].field == "deployment"


@pytest.mark.parametrize(("start", "end"), [("0.32", "0.33"), ("0.33", "0.32"), ("0.33", "0.33")])
@pytest.mark.parametrize("fail_on", [DEFAULT_FAIL_ON, ("verdict",), ("error", "backend")])
def test_the_response_reads_back_as_the_local_json(
    start: str, end: str, fail_on: tuple[str, ...]
) -> None:
    diff = upgrade(SPEC, start, end)
    message = codec.diff_response(diff, fail_on)
    response = pb.DiffRulesetsResponse.FromString(message.SerializeToString())
    assert codec.upgrade_response_to_json(response) == diff.to_json(fail_on)
    assert response.changed == diff.to_json(fail_on)["changed"]
    assert [d.fails_gate for d in response.changes] == [d.fails(fail_on) for d in diff.changes]
    assert [a.ruleset for a in response.answers] == [a.ruleset for a in diff.answers]
    kinds = [a.WhichOneof("answer") for a in response.answers]
    assert kinds == ["failure" if a.failure else "decision" for a in diff.answers]


def test_consecutive_differences_and_changes_keep_their_rulesets() -> None:
    diff = diff_rulesets(SPEC, ["vllm-0.32", "vllm-0.33", "vllm-0.32"])
    response = codec.diff_response(diff, DEFAULT_FAIL_ON)
    steps = {(d.from_ruleset, d.to_ruleset) for d in response.differences}
    assert steps == {("vllm-0.32", "vllm-0.33"), ("vllm-0.33", "vllm-0.32")}
    assert list(response.changes) == []  # back where it started
    assert [codec.difference_json(d) for d in response.differences] == [
        d.to_json() for d in diff.differences
    ]
