"""ReportDecisions' bounds and ListObservedDecisions' messages."""

from __future__ import annotations

import json

import pytest

from service.api.codecs import observed as codec
from service.api.generated.moe_control.v1 import observed_pb2
from service.dataplane.observed import Observations
from service.metrics import Metrics
from service.oracle import InvalidSpecError, select

SPEC = {
    "hf_quantization_config": {
        "quant_method": "gptq",
        "bits": 4,
        "group_size": 128,
        "desc_act": False,
        "sym": True,
    },
    "layer": {"num_experts": 8, "top_k": 2, "hidden_size": 1024, "intermediate_size": 512},
    "platform": "h100",
}


def report(decisions: int = 1, **fields: object) -> observed_pb2.ReportDecisionsRequest:
    answer = select(SPEC)
    key = answer.weight_key
    assert key is not None
    decision = observed_pb2.ObservedDecision(
        layer_name="model.layers.0.mlp.experts",
        weight_key=observed_pb2.ObservedWeightKey(
            dtype=key.dtype,
            scale_dtype=key.scale_dtype,
            group_shape=list(key.group_shape),
            symmetric=key.symmetric,
        ),
        may_have_zp=bool(answer.may_have_zp),
        may_have_bias=bool(answer.may_have_bias),
        allow_tile_padding=bool(answer.allow_tile_padding),
        moe_method=answer.moe_method,
        integration=answer.quantization,
        deployment_json=json.dumps(SPEC),
        backend=answer.backend or "",
        experts_class=answer.experts_class or "",
        candidates=[
            observed_pb2.ObservedCandidate(
                backend=c.backend,
                verdict=observed_pb2.ObservedVerdict.Value(f"OBSERVED_VERDICT_{c.verdict.upper()}"),
                reason=c.reason,
            )
            for c in answer.candidates
        ],
    )
    for name, value in fields.items():
        setattr(decision, name, value)
    return observed_pb2.ReportDecisionsRequest(
        process=observed_pb2.ReportingProcess(host="h", vllm_version="0.33.0"),
        decisions=[decision] * decisions,
    )


def test_a_report_round_trips_through_the_store() -> None:
    process, decisions = codec.report_request(report())
    store = Observations(Metrics())
    store.report(process, decisions)
    (entry,) = codec.listing_response(store.listing(), store.evicted).deployments
    assert entry.count == 1 and entry.ruleset == "vllm-0.33" and not entry.first_difference
    assert entry.predicted.backend == entry.observed.backend
    assert [c.verdict for c in entry.predicted.candidates] == [
        c.verdict for c in entry.observed.candidates
    ]


def test_a_batch_over_the_limit_is_refused_naming_the_field() -> None:
    with pytest.raises(InvalidSpecError) as refused:
        codec.report_request(report(codec.MAX_BATCH + 1))
    assert [v.field for v in refused.value.violations] == ["decisions"]


def test_every_oversized_field_is_named_at_once() -> None:
    with pytest.raises(InvalidSpecError) as refused:
        codec.report_request(
            report(
                deployment_json="x" * (codec.MAX_DEPLOYMENT_BYTES + 1),
                layer_name="y" * (codec.MAX_TEXT + 1),
            )
        )
    assert {v.field for v in refused.value.violations} == {
        "decisions[0].deployment_json",
        "decisions[0].layer_name",
    }


def test_a_decision_without_its_deployment_is_refused() -> None:
    with pytest.raises(InvalidSpecError) as refused:
        codec.report_request(report(deployment_json=""))
    assert [v.field for v in refused.value.violations] == ["decisions[0].deployment_json"]
