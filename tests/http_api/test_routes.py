"""Every route of the HTTP/JSON API in process (starlette's TestClient): the same JSON the
CLI's `--json` prints, from the same data plane."""

from __future__ import annotations

from starlette.testclient import TestClient

from service.api.codecs.answer_cache import AnswerCache
from service.api.codecs.messages import presets_json
from service.api.codecs.rulesets import rulesets_from_pb, rulesets_response
from service.api.codecs.selection import presets_response
from service.cli.select import answer
from service.oracle import deployment_from_model_config
from tests.http_api.conftest import CONFIG, SPEC, make_client


def test_select_a_spec_answers_as_select_json(client: TestClient) -> None:
    response = client.post("/v1/select", json={**SPEC, "id": "q"})
    assert response.status_code == 200
    expected, code = answer({**SPEC, "id": "q"})
    assert code == 0
    assert response.json() == expected
    assert next(iter(response.json())) == "id"


def test_select_a_config_with_a_platform(client: TestClient) -> None:
    response = client.post("/v1/select", json={"config": CONFIG, "platform": "a100"})
    assert response.status_code == 200
    expected, _ = answer({**deployment_from_model_config(CONFIG), "platform": "a100"})
    assert response.json() == expected
    assert response.json()["backend"] == "MARLIN"


def test_select_without_a_platform_is_the_workers() -> None:
    test_client, _ = make_client()
    spec = {k: v for k, v in SPEC.items() if k != "platform"}
    body = test_client.post("/v1/select", json=spec).json()
    assert body["platform"]["preset"] == "a100"


def test_select_vllm_fails_is_failed_precondition_with_per_backend_reasons(
    client: TestClient,
) -> None:
    response = client.post("/v1/select", json={**SPEC, "moe_backend": "marlin", "platform": "v100"})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["status"] == "FAILED_PRECONDITION"
    types = [d["@type"].rsplit("/", 1)[1] for d in error["details"]]
    assert "google.rpc.PreconditionFailure" in types
    assert "moe_control.v1.SelectionFailure" in types
    violations = next(d for d in error["details"] if d["@type"].endswith("PreconditionFailure"))
    assert all({"type", "subject", "description"} <= set(v) for v in violations["violations"])


def test_matrix(client: TestClient) -> None:
    body = {
        "configs": [{"name": "qwen", "config": CONFIG}],
        "gpus": ["a100", "h200"],
        "rulesets": ["vllm-0.33"],
    }
    response = client.post("/v1/select:matrix", json=body)
    assert response.status_code == 200
    matrix = response.json()
    assert matrix["gpus"] == ["a100", "h200"]
    assert [(c["gpu"], c["backend"]) for c in matrix["cells"]] == [
        ("a100", "MARLIN"),
        ("h200", "HUMMING"),
    ]
    by_name = client.post(
        "/v1/select:matrix", json={"configs": {"qwen": CONFIG}, "gpus": "all"}
    ).json()
    assert len(by_name["cells"]) == len(by_name["gpus"]) > 2


def test_matrix_names_a_bad_field(client: TestClient) -> None:
    response = client.post("/v1/select:matrix", json={"configs": {"q": CONFIG}, "gpus": ["zz"]})
    assert response.status_code == 400
    fields = [v["field"] for v in response.json()["error"]["details"][0]["field_violations"]]
    assert fields == ["gpus[0]"]
    response = client.post("/v1/select:matrix", json={"gpus": ["a100"]})
    assert response.json()["error"]["details"][0]["field_violations"][0]["field"] == "configs"


def test_listings(client: TestClient) -> None:
    assert client.get("/v1/platforms").json() == presets_json(presets_response())
    assert client.get("/v1/rulesets").json() == rulesets_from_pb(rulesets_response())
    workers = client.get("/v1/workers").json()
    assert workers["ready"] is True and workers["ready_workers"] == 1
    assert workers["workers"][0]["platform"]["preset"] == "a100"
    layers = client.get("/v1/layers").json()
    assert layers[0]["layer_id"] == "l1"
    assert layers[0]["byte_size"] == 2**40  # a number, as the CLI prints it
    assert client.get("/v1/layers?worker_index=0").status_code == 200


def test_layers_of_an_unknown_worker_is_404_with_resource_info(client: TestClient) -> None:
    response = client.get("/v1/layers?worker_index=7")
    assert response.status_code == 404
    detail = response.json()["error"]["details"][0]
    assert detail["@type"].endswith("google.rpc.ResourceInfo")
    assert detail["resource_type"] == "worker"
    response = client.get("/v1/layers?worker_index=x")
    assert response.status_code == 400
    violation = response.json()["error"]["details"][0]["field_violations"][0]
    assert violation["field"] == "worker_index"


def test_health_and_readiness() -> None:
    ready, _ = make_client(ready=True)
    assert ready.get("/healthz").json() == {"status": "SERVING"}
    assert ready.get("/readyz").json() == {"status": "SERVING"}
    not_ready, _ = make_client(ready=False)
    assert not_ready.get("/healthz").status_code == 200
    response = not_ready.get("/readyz")
    assert response.status_code == 503
    assert response.json() == {"status": "NOT_SERVING"}


def test_unknown_route_and_method(client: TestClient) -> None:
    response = client.get("/v1/nothing")
    assert response.status_code == 404
    assert response.json()["error"]["status"] == "NOT_FOUND"
    response = client.get("/v1/select")
    assert response.status_code == 405
    assert response.headers["allow"] == "POST"
    assert response.json()["error"]["code"] == 405


def _sample(text: str, name: str, labels: str) -> float:
    prefix = f"{name}{{{labels}}} "
    line = next(line for line in text.splitlines() if line.startswith(prefix))
    return float(line[len(prefix) :])


def test_metrics_count_routes_and_codes() -> None:
    test_client, metrics = make_client()
    requests = "moe_control_http_requests_total"
    select = 'code="{}",method="POST",route="/v1/select"'
    # every route's series exists at zero from the start
    assert _sample(metrics.exposition().decode(), requests, select.format(200)) == 0
    test_client.post("/v1/select", json=SPEC)
    test_client.post("/v1/select", content=b"{")
    test_client.get("/v1/nothing")
    text = metrics.exposition().decode()
    assert _sample(text, requests, select.format(200)) == 1
    assert _sample(text, requests, select.format(400)) == 1
    assert _sample(text, requests, 'code="404",method="GET",route="unmatched"') == 1
    count = "moe_control_http_request_duration_seconds_count"
    assert _sample(text, count, 'method="POST",route="/v1/select"') == 2
    # the decisions are counted as gRPC's are (the same selector)
    assert "moe_control_backend_selections_total{" in text


def test_openapi_is_served(client: TestClient) -> None:
    document = client.get("/v1/openapi.json").json()
    assert document["openapi"].startswith("3.1")
    assert "/v1/select:matrix" in document["paths"]


def test_a_repeated_select_is_answered_from_the_kept_bytes_and_counted() -> None:
    cache = AnswerCache(1 << 20)
    test_client, metrics = make_client(cache=cache)
    first = test_client.post("/v1/select", json=SPEC)
    second = test_client.post("/v1/select", json=SPEC)
    assert first.status_code == second.status_code == 200
    assert first.content == second.content
    assert (cache.hits, len(cache)) == (1, 1)
    selections = metrics.backend_selections.collect()[0].samples
    assert sum(s.value for s in selections if s.name.endswith("_total")) == 2
    assert test_client.post("/v1/select", json={"layer": 1}).status_code == 400
    assert len(cache) == 1  # errors are not kept
