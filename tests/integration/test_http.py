"""The HTTP/JSON API of the real server (`moe-control serve --http-port N`), spoken over
loopback with plain urllib (what curl does): POST /v1/select answers exactly what
`moe-control select --json` prints for the same spec, the listings and the probes answer,
a token guards everything but the probes."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from integration.serverproc import ServerProcess, launch, wait_ready
from service.oracle import DEFAULT_RULESET

SPEC: dict[str, Any] = {
    "id": "curl",
    "hf_quantization_config": {
        "quant_method": "gptq",
        "bits": 4,
        "group_size": 128,
        "sym": True,
        "desc_act": False,
    },
    "layer": {"num_experts": 64, "top_k": 6, "hidden_size": 2048, "intermediate_size": 1408},
    "platform": "h200",
}
TOKEN = "integration-token"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    proc = launch("--http-port", str(_free_port()), "--auth-token", TOKEN)
    try:
        assert proc.http_url is not None, "the listening line names no HTTP URL"
        wait_ready(proc)  # gRPC health: no token needed
        yield proc
    finally:
        code = proc.stop()
    assert code == 0, "".join(proc.stderr_lines)  # the HTTP door drained with the rest


def _call(
    url: str, body: Any = None, token: str | None = TOKEN, raw: bytes | None = None
) -> tuple[int, Any]:
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    request = urllib.request.Request(url, data=data, method="POST" if data is not None else "GET")
    request.add_header("Content-Type", "application/json")
    if token is not None:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def test_select_answers_as_the_cli_does(server: ServerProcess, tmp_path) -> None:  # type: ignore[no-untyped-def]
    status, answer = _call(f"{server.http_url}/v1/select", SPEC)
    assert status == 200
    spec_file = tmp_path / "spec.json"
    spec_file.write_text(json.dumps(SPEC))
    cli = subprocess.run(
        [sys.executable, "-m", "service.cli", "select", "--deployment", str(spec_file), "--json"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert answer == json.loads(cli.stdout)
    assert answer["backend"] == "HUMMING"


def test_listings_probes_and_errors(server: ServerProcess) -> None:
    base = server.http_url
    status, workers = _call(f"{base}/v1/workers")
    assert status == 200 and workers["ready_workers"] == 1
    assert _call(f"{base}/v1/layers")[0] == 200
    rulesets = _call(f"{base}/v1/rulesets")[1]
    assert [r["name"] for r in rulesets if r["default"]] == [DEFAULT_RULESET]
    assert any(p["name"] == "h200" for p in _call(f"{base}/v1/platforms")[1])
    assert _call(f"{base}/healthz", token=None) == (200, {"status": "SERVING"})
    assert _call(f"{base}/readyz", token=None) == (200, {"status": "SERVING"})
    status, error = _call(f"{base}/v1/select", SPEC, token=None)
    assert status == 401 and error["error"]["status"] == "UNAUTHENTICATED"
    status, error = _call(f"{base}/v1/select", raw=b"{oops")
    assert status == 400
    assert error["error"]["details"][0]["field_violations"][0]["field"] == "body"
    status, matrix = _call(
        f"{base}/v1/select:matrix",
        {"configs": {"m": _config()}, "gpus": ["a100", "h200"]},
    )
    assert status == 200 and [c["backend"] for c in matrix["cells"]] == ["MARLIN", "HUMMING"]


def test_http_metrics_are_exported(server: ServerProcess) -> None:
    assert server.metrics_url is not None
    text = urllib.request.urlopen(server.metrics_url, timeout=5).read().decode()
    assert 'moe_control_http_requests_total{code="200",method="POST",route="/v1/select"}' in text


def _config() -> dict[str, Any]:
    path = Path(__file__).resolve().parents[2] / "docs/examples/qwen2-moe-gptq-config.json"
    config: dict[str, Any] = json.loads(path.read_text())
    return config
