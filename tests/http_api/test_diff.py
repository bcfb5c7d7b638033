"""POST /v1/diff in process: the contract the what-if page reads (from, to, changed, both
answers as POST /v1/select gives them, the differences with their causes), the answers
the data plane gives, and bad bodies naming their field."""

from __future__ import annotations

from typing import Any

from starlette.testclient import TestClient

from service.oracle import deployment_from_model_config
from service.oracle.rulesets import RULESETS
from service.oracle.upgrade import upgrade
from tests.http_api.conftest import CONFIG, GPTQ

LAYER = {
    "num_experts": 8,
    "top_k": 2,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "activation": "gelu_tanh",
}
GELU_ON_CPU = {"hf_quantization_config": GPTQ, "layer": LAYER, "platform": "cpu"}


def field_of(response: Any) -> str:
    error = response.json()["error"]
    bad = next(d for d in error["details"] if d["@type"].endswith("google.rpc.BadRequest"))
    return str(bad["field_violations"][0]["field"])


def test_the_contract_and_the_data_plane_s_answer(client: TestClient) -> None:
    response = client.post(
        "/v1/diff", json={"from": "0.32", "to": "v0.33.0", "deployment": GELU_ON_CPU}
    )
    assert response.status_code == 200
    body = response.json()
    assert list(body) == [
        "from",
        "to",
        "fail_on",
        "changed",
        "before",
        "after",
        "differences",
        "other_differences",
    ]
    assert (body["from"], body["to"], body["changed"]) == ("vllm-0.32", "vllm-0.33", True)
    assert body == upgrade(GELU_ON_CPU, "vllm-0.32", "vllm-0.33").to_json()
    assert body["before"]["error"]["stage"] == "backend"
    assert [d["field"] for d in body["differences"]] == ["backend", "experts_class", "error"]
    assert "verdict.CPU" in [d["field"] for d in body["other_differences"]]
    every = body["differences"] + body["other_differences"]
    assert all(set(d) == {"field", "before", "after", "cause"} for d in every)


def test_fail_on_chooses_the_gated_fields(client: TestClient) -> None:
    body = {"from": "0.32", "to": "0.33", "deployment": GELU_ON_CPU, "fail_on": ["verdict"]}
    answer = client.post("/v1/diff", json=body).json()
    assert answer["fail_on"] == ["verdict"] and answer["changed"] is True
    assert answer == upgrade(GELU_ON_CPU, "0.32", "0.33").to_json(("verdict",))
    assert {d["field"] for d in answer["differences"]} == {"verdict.CPU"}


def test_an_unknown_fail_on_field_names_it_and_lists_the_accepted(client: TestClient) -> None:
    for fail_on in (["stage"], "backend", [1]):
        body = {"from": "0.32", "to": "0.33", "deployment": GELU_ON_CPU, "fail_on": fail_on}
        response = client.post("/v1/diff", json=body)
        assert response.status_code == 400 and field_of(response) == "fail_on", fail_on
        assert (
            "backend, experts_class, failure, error, verdict"
            in (response.json()["error"]["message"])
        )


def test_after_is_the_select_answer_under_to(client: TestClient) -> None:
    selected = client.post("/v1/select", json={**GELU_ON_CPU, "ruleset": "vllm-0.33"}).json()
    body = client.post(
        "/v1/diff", json={"from": "vllm-0.32", "to": "vllm-0.33", "deployment": GELU_ON_CPU}
    ).json()
    # the same answer, less the what-would-change search a diff does not run
    assert body["after"] == {**selected, "what_would_change": None}


def test_a_config_deployment_without_a_platform_is_decided_for_worker_0(
    client: TestClient,
) -> None:
    body = client.post(
        "/v1/diff", json={"from": "0.32", "to": "0.33", "deployment": {"config": CONFIG}}
    ).json()
    assert body["before"]["platform"]["preset"] == "a100"  # the worker's own
    expected = upgrade({**deployment_from_model_config(CONFIG), "platform": "a100"}, "0.32", "0.33")
    assert body == expected.to_json() and not body["changed"]


def test_the_same_ruleset_twice_changes_nothing(client: TestClient) -> None:
    body = client.post(
        "/v1/diff", json={"from": "0.33", "to": "0.33", "deployment": GELU_ON_CPU}
    ).json()
    assert body["changed"] is False and body["differences"] == []
    assert body["before"] == body["after"]


def test_bad_bodies_name_their_field(client: TestClient) -> None:
    unknown = client.post("/v1/diff", json={"from": "0.99", "to": "0.33", "deployment": {}})
    assert unknown.status_code == 400 and field_of(unknown) == "from"
    assert f"known: {next(iter(RULESETS))}" in unknown.json()["error"]["message"]
    missing = client.post("/v1/diff", json={"from": "0.32", "to": "0.33"})
    assert missing.status_code == 400 and field_of(missing) == "deployment"
    blank = client.post("/v1/diff", json={"from": "0.32", "deployment": GELU_ON_CPU})
    assert blank.status_code == 400 and field_of(blank) == "to"
    invalid = client.post(
        "/v1/diff", json={"from": "0.32", "to": "0.33", "deployment": {"layer": {}}}
    )
    assert invalid.status_code == 400 and invalid.json()["error"]["status"] == "INVALID_ARGUMENT"
    broken = client.post("/v1/diff", content=b"{nope")
    assert broken.status_code == 400 and field_of(broken) == "body"
