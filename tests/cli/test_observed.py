"""`moe-control observed`'s table: each deployment with its count, release, ruleset and
backend, and for a mismatch both answers and the first field that differs."""

from __future__ import annotations

import dataclasses
import json

from service.api.codecs import observed as codec
from service.api.codecs.messages import message_json
from service.cli.observed import render_table
from service.dataplane.observed import Observations, ObservedDecision, ReportingProcess
from service.metrics import Metrics
from service.oracle import DEFAULT_RULESET, select
from service.oracle.observed import predicted_outcome
from service.oracle.releases import RELEASES, add_release_howto

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


def test_the_table_shows_agreement_and_a_mismatch() -> None:
    predicted = predicted_outcome(select(SPEC))
    agreeing = ObservedDecision("model.layers.0.mlp.experts", 1, json.dumps(SPEC), predicted)
    other = {**SPEC, "layer": {**SPEC["layer"], "num_experts": 16}}
    wrong = ObservedDecision(
        "model.layers.0.mlp.experts",
        1,
        json.dumps(other),
        dataclasses.replace(predicted, backend="MARLIN", experts_class="MarlinExperts"),
    )
    store = Observations(Metrics())
    store.report(ReportingProcess(host="a", vllm_version="0.33.0"), [agreeing, wrong])
    store.report(ReportingProcess(host="b", vllm_version="0.33.0"), [agreeing])
    listing = message_json(codec.listing_response(store.listing(), store.evicted))
    text = render_table(listing)
    assert text.splitlines()[0] == "2 observed deployments, 1 mismatched"
    assert "differs at backend" in text and "yes" in text
    assert f"vLLM MARLIN (MarlinExperts), vllm-0.33 says {predicted.backend}" in text
    assert "first difference backend: vLLM 'MARLIN'" in text
    counts = [line.split()[0] for line in text.splitlines()[2:4]]
    assert sorted(counts) == ["1", "2"]


def test_a_release_no_ruleset_models_is_said_so() -> None:
    release = RELEASES[DEFAULT_RULESET]
    major, minor = (int(p) for p in release.below.split(".")[:2])
    newer = f"{major}.{minor + 1}.0"
    decision = ObservedDecision(
        "model.layers.0.mlp.experts",
        1,
        json.dumps(SPEC),
        predicted_outcome(select(SPEC, ruleset=DEFAULT_RULESET)),
    )
    store = Observations(Metrics())
    store.report(ReportingProcess(host="a", vllm_version=newer), [decision])
    store.report(ReportingProcess(host="a", vllm_version=release.first), [decision])
    listing = message_json(codec.listing_response(store.listing(), store.evicted))
    assert [d["release_not_modelled"] for d in listing["deployments"]] == [False, True]
    lines = render_table(listing).splitlines()
    assert lines[0] == f"2 observed deployments, 0 mismatched; releases not modelled: {newer}"
    (row,) = [line for line in lines if f"{newer} (not modelled)" in line]
    assert DEFAULT_RULESET in row and row.endswith("yes")  # it decides as the nearest one
    (said,) = [line for line in lines if line.startswith("release not modelled ")]
    assert f"vLLM {newer} is not modelled: compared with {DEFAULT_RULESET}" in said
    assert said.endswith(add_release_howto(newer))
