"""The HTTP door's one error shape and its limits: malformed JSON (400, the field named),
the bearer token (401; the probes exempt), the body size (413, the limit named), the
per-method concurrency limit shared with gRPC (429, gRPC's details)."""

from __future__ import annotations

import asyncio
import json

import pytest
from google.rpc import code_pb2
from starlette.testclient import TestClient

from service.api.errors import MAPPINGS, ConcurrencyLimitError, status_for
from service.api.interceptors.limits import Limits
from service.http.errors import HTTP_STATUS, error_json
from service.metrics import Metrics
from service.oracle import InvalidSpecError
from service.oracle.releases import DEFAULT_RULESET, RELEASES, add_release_howto
from service.pool.errors import LayerNotFoundError, WorkerUnavailableError
from service.settings import Settings
from tests.http_api.conftest import SPEC, TOKEN, make_client


def _violations(body: dict) -> list[tuple[str, str]]:
    for detail in body["error"]["details"]:
        if detail["@type"].endswith("google.rpc.BadRequest"):
            return [(v["field"], v["description"]) for v in detail["field_violations"]]
    return []


@pytest.mark.parametrize(
    ("body", "field"),
    [
        (b"{not json", "body"),
        (b"\xff\xfe", "body"),
        (b"[1, 2]", "body"),
        (b'{"config": 3}', "config"),
        (b'{"layer": {"top_k": "six"}, "platform": "h200"}', "layer.top_k"),
    ],
)
def test_malformed_json_is_400_naming_the_field(body: bytes, field: str) -> None:
    client, _ = make_client()
    response = client.post("/v1/select", content=body)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["code"] == 400 and error["status"] == "INVALID_ARGUMENT"
    assert field in [f for f, _ in _violations(response.json())]


def test_every_mapped_code_has_an_http_status() -> None:
    for row in MAPPINGS:
        assert row.code in HTTP_STATUS
    assert HTTP_STATUS[code_pb2.FAILED_PRECONDITION] == 400
    assert HTTP_STATUS[code_pb2.UNAVAILABLE] == 503


def test_the_details_are_the_grpc_status_details_as_json() -> None:
    for exc in (
        InvalidSpecError.single("layer.top_k", "required"),
        LayerNotFoundError("l9"),
        WorkerUnavailableError("starting"),
        ConcurrencyLimitError("/moe_control.v1.MoeControlService/SelectBackend", "x", 3),
    ):
        status, body = error_json(exc)
        grpc_status = status_for(exc)
        assert status == HTTP_STATUS[grpc_status.code]
        assert body["error"]["message"] == grpc_status.message
        assert [d["@type"] for d in body["error"]["details"]] == [
            d.type_url for d in grpc_status.details
        ]
        json.dumps(body)


def test_internal_errors_say_nothing_of_their_cause() -> None:
    status, body = error_json(RuntimeError("secret path /etc/x"))
    assert status == 500
    assert "secret" not in json.dumps(body)


def test_token_required_but_not_for_probes() -> None:
    client, _ = make_client(Settings(auth_token=TOKEN))
    response = client.post("/v1/select", json=SPEC)
    assert response.status_code == 401
    assert response.headers["www-authenticate"] == "Bearer"
    assert response.json()["error"]["status"] == "UNAUTHENTICATED"
    wrong = client.post("/v1/select", json=SPEC, headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 401
    basic = client.get("/v1/platforms", headers={"Authorization": f"Basic {TOKEN}"})
    assert basic.status_code == 401
    right = client.post("/v1/select", json=SPEC, headers={"Authorization": f"Bearer {TOKEN}"})
    assert right.status_code == 200
    assert client.get("/healthz").status_code == 200
    assert client.get("/readyz").status_code == 200
    assert client.get("/v1/rulesets").status_code == 401


def test_token_from_the_token_file(tmp_path) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "token"
    path.write_text(TOKEN + "\n")
    client, _ = make_client(Settings(auth_token_file=path))
    assert client.get("/v1/platforms").status_code == 401
    headers = {"Authorization": f"bearer {TOKEN}"}
    assert client.get("/v1/platforms", headers=headers).status_code == 200


def test_body_over_the_limit_is_413_naming_it() -> None:
    client, _ = make_client(Settings(max_receive_message_bytes=1024))
    response = client.post("/v1/select", content=b" " * 2048)
    assert response.status_code == 413
    error = response.json()["error"]
    assert "1024" in error["message"] and "max_receive_message_bytes" in error["message"]
    info = next(d for d in error["details"] if d["@type"].endswith("ErrorInfo"))
    assert info["metadata"] == {
        "field": "body",
        "limit": "max_receive_message_bytes",
        "value": "1024",
    }

    def chunks():  # type: ignore[no-untyped-def]  # no Content-Length: streamed
        for _ in range(4):
            yield b" " * 512

    streamed = client.post("/v1/select", content=chunks())
    assert streamed.status_code == 413
    assert client.post("/v1/select", json=SPEC).status_code == 200


def test_the_select_limit_is_shared_with_grpc() -> None:
    metrics = Metrics()
    settings = Settings(max_concurrent_select=1)
    limits = Limits.from_settings(settings, metrics)
    client, _ = make_client(settings, metrics=metrics, limits=limits)
    limit = limits.for_method("/moe_control.v1.MoeControlService/SelectBackend")
    assert limit is not None
    asyncio.run(limit.semaphore.acquire())  # a gRPC SelectBackend holds the only slot
    try:
        response = client.post("/v1/select", json=SPEC)
        assert response.status_code == 429
        assert response.headers["retry-after"] == "1"
        error = response.json()["error"]
        assert error["status"] == "RESOURCE_EXHAUSTED"
        info = next(d for d in error["details"] if d["@type"].endswith("ErrorInfo"))
        assert info["reason"] == "CONCURRENCY_LIMIT"
        assert info["metadata"]["limit"] == "max_concurrent_select"
        assert client.get("/v1/platforms").status_code == 200  # not limited
    finally:
        limit.release()
    assert client.post("/v1/select", json=SPEC).status_code == 200
    assert limit.available == 1


def test_a_release_newer_than_every_ruleset_is_400_naming_the_newest_and_how_to_add_it(
    client: TestClient,
) -> None:
    newest = RELEASES[DEFAULT_RULESET]
    major, minor = (int(part) for part in newest.below.split(".")[:2])
    newer = f"{major}.{minor + 1}.0"
    response = client.post("/v1/select", json={**SPEC, "ruleset": f"vllm=={newer}"})
    assert response.status_code == 400
    assert response.json()["error"]["status"] == "INVALID_ARGUMENT"
    ((field, description),) = _violations(response.json())
    assert field == "ruleset"
    assert f"vLLM {newer} is newer than every ruleset (the newest is {newest.name})" in description
    assert description.endswith(add_release_howto(newer))
