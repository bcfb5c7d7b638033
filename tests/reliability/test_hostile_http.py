"""Hostile input over real loopback HTTP against one real server's HTTP/JSON door.

Random bytes, random and deeply nested JSON, wrong types in every field, bodies over the
size limit (declared and streamed), odd paths, methods and headers: every answer is a
well-formed JSON answer (a 2xx, or the one error shape with an allowed status; 400
INVALID_ARGUMENT names a field), the server never crashes (checked after every test) and
never hangs (every request has a timeout). MOE_CONTROL_FUZZ_EXAMPLES scales the
properties as in test_hostile_input.py.
"""

from __future__ import annotations

import http.client
import json
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlsplit

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from integration.serverproc import ServerProcess, launch, wait_ready

from reliability import wire

LIMIT = 64 * 1024
PAGE_FILES = Path(__file__).resolve().parents[2] / "service" / "http" / "static"
FUZZ = settings(
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
ALLOWED = {200, 400, 401, 404, 405, 413, 429, 503}
GPTQ = {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": False, "sym": True}
LAYER = {"num_experts": 8, "top_k": 2, "hidden_size": 256, "intermediate_size": 128}
SPEC = {"hf_quantization_config": GPTQ, "layer": LAYER, "platform": "a100"}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture(scope="module")
def door() -> Iterator[ServerProcess]:
    process = launch("--http-port", str(_free_port()), "--max-receive-message-bytes", str(LIMIT))
    wait_ready(process)
    yield process
    alive = process.process.poll() is None
    process.stop()
    assert alive, "the server died:\n" + "".join(process.stderr_lines[-40:])


@pytest.fixture(autouse=True)
def still_serving(door: ServerProcess) -> Iterator[None]:
    yield
    assert door.process.poll() is None, "".join(door.stderr_lines[-40:])
    assert request(door, "GET", "/healthz")[0] == 200


def request(
    door: ServerProcess,
    method: str,
    path: str,
    body: bytes | None = None,
    headers: dict[str, str] | None = None,
) -> tuple[int, Any]:
    assert door.http_url is not None
    where = urlsplit(door.http_url)
    connection = http.client.HTTPConnection(where.hostname, where.port, timeout=10)
    try:
        connection.request(method, path, body=body, headers=headers or {})
        response = connection.getresponse()
        data = response.read()
    finally:
        connection.close()
    try:
        return response.status, (json.loads(data) if data else None)
    except ValueError:
        return response.status, data.decode("utf-8", "replace")


def check(status: int, answer: Any) -> None:
    assert status in ALLOWED, (status, answer)
    if status == 200:
        return
    if answer == {"status": "NOT_SERVING"}:
        return
    if status == 400 and isinstance(answer, str):
        return  # HTTP itself malformed (a negative Content-Length): uvicorn's own refusal
    error = answer["error"]
    assert error["code"] == status
    assert isinstance(error["message"], str) and error["message"]
    assert all("@type" in detail for detail in error["details"])
    if error["status"] == "INVALID_ARGUMENT":
        violations = [
            v
            for d in error["details"]
            if d["@type"].endswith("google.rpc.BadRequest")
            for v in d["field_violations"]
        ]
        # named (an unknown key "" is named as itself, the empty string)
        assert violations and all("field" in v for v in violations), error


ROUTES = ("/v1/select", "/v1/select:matrix", "/v1/diff")
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda children: (
        st.lists(children, max_size=5) | st.dictionaries(st.text(max_size=10), children, max_size=5)
    ),
    max_leaves=30,
)


@given(route=st.sampled_from(ROUTES), data=st.binary(max_size=512))
@settings(FUZZ, max_examples=wire.examples(40))
def test_random_bytes(door: ServerProcess, route: str, data: bytes) -> None:
    check(*request(door, "POST", route, data))


@given(route=st.sampled_from(ROUTES), value=json_values)
@settings(FUZZ, max_examples=wire.examples(60))
def test_random_json(door: ServerProcess, route: str, value: Any) -> None:
    check(*request(door, "POST", route, json.dumps(value).encode()))


@given(
    key=st.sampled_from([*SPEC, "config", "id"]),
    value=json_values,
    nested=st.sampled_from(["", "layer", "parallel"]),
)
@settings(FUZZ, max_examples=wire.examples(60))
def test_wrong_types_in_a_spec(door: ServerProcess, key: str, value: Any, nested: str) -> None:
    spec: dict[str, Any] = json.loads(json.dumps(SPEC))
    if nested:
        spec[nested] = {**(spec.get(nested) or {}), key: value}
    else:
        spec[key] = value
    check(*request(door, "POST", "/v1/select", json.dumps(spec).encode()))


@given(
    configs=json_values,
    gpus=st.one_of(json_values, st.lists(st.sampled_from(["a100", "h200", "zz", ""]))),
    rulesets=json_values,
)
@settings(FUZZ, max_examples=wire.examples(40))
def test_matrix_bodies(door: ServerProcess, configs: Any, gpus: Any, rulesets: Any) -> None:
    body = {"configs": configs, "gpus": gpus, "rulesets": rulesets}
    check(*request(door, "POST", "/v1/select:matrix", json.dumps(body).encode()))


@given(start=json_values, end=json_values, deployment=json_values)
@settings(FUZZ, max_examples=wire.examples(40))
def test_diff_bodies(door: ServerProcess, start: Any, end: Any, deployment: Any) -> None:
    body = {"from": start, "to": end, "deployment": deployment}
    check(*request(door, "POST", "/v1/diff", json.dumps(body).encode()))
    named = {"from": "vllm-0.32", "to": "vllm-0.33", "deployment": {**SPEC, "layer": deployment}}
    check(*request(door, "POST", "/v1/diff", json.dumps(named).encode()))


def test_deeply_nested_json(door: ServerProcess) -> None:
    for depth in (100, 5000):
        check(*request(door, "POST", "/v1/select", b"[" * depth + b"]" * depth))
        check(*request(door, "POST", "/v1/select", b'{"a":' * depth + b"1" + b"}" * depth))


def test_bodies_over_the_limit(door: ServerProcess) -> None:
    status, answer = request(door, "POST", "/v1/select", b" " * (LIMIT + 1))
    assert status == 413 and str(LIMIT) in answer["error"]["message"]
    # a lying Content-Length: refused on what it declares
    status, _ = request(door, "POST", "/v1/select", b"{}", {"Content-Length": str(LIMIT * 10)})
    assert status in (400, 413)
    check(*request(door, "POST", "/v1/select", b"{}", {"Content-Length": "-5"}))


@given(
    method=st.sampled_from(["GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "BREW"]),
    path=st.sampled_from(
        [
            *ROUTES,
            "/v1/workers",
            "/v1/layers?worker_index=-1",
            "/v1/%00",
            "/v1/layers?worker_index=99999999999999999999",
            "/../etc/passwd",
            "/v1/select/..",
            "/" + "a" * 2000,
        ]
    ),
    auth=st.sampled_from(["", "Bearer", "Bearer  ", "Basic x", "Bearer " + "x" * 4000]),
)
@settings(FUZZ, max_examples=wire.examples(60))
def test_odd_methods_paths_and_headers(
    door: ServerProcess, method: str, path: str, auth: str
) -> None:
    headers = {"Authorization": auth} if auth else {}
    body = b"{}" if method in ("POST", "PUT", "PATCH") else None
    check(*request(door, method, path, body, headers))


@given(name=st.text(max_size=60), method=st.sampled_from(["GET", "HEAD", "POST"]))
@settings(FUZZ, max_examples=wire.examples(60))
def test_page_paths(door: ServerProcess, name: str, method: str) -> None:
    """Any path under the what-if page's folder is a file of the page (200) or not (404,
    a plain answer), and no other method is taken (405); nothing else, no file of the
    server's disk."""
    status, answer = request(door, method, "/page/" + quote(name, safe="/."))
    if method == "POST":
        assert status == 405, (status, answer)
        return
    assert status in (200, 404), (status, name)
    if status == 200:
        assert (PAGE_FILES / name).is_file() or name == "examples.json", name
