"""The what-if page's files on the HTTP port: served from the package at / and /page/,
with a policy that allows this origin only, nothing loaded from outside, no request path
reaching the file system, public while the API needs its token, and every page file
declared package data (so a built wheel carries it)."""

from __future__ import annotations

import fnmatch
import re
import tomllib

from starlette.testclient import TestClient

from service.http.page import FILE_ROUTE, INDEX_ROUTE, page_files
from service.settings import Settings

from .conftest import ROOT, TOKEN, make_client

STATIC = ROOT / "service" / "http" / "static"


def test_the_page_is_at_the_root_with_a_same_origin_policy(client: TestClient) -> None:
    response = client.get("/")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/html")
    policy = response.headers["content-security-policy"]
    assert "default-src 'self'" in policy
    assert response.headers["x-content-type-options"] == "nosniff"
    assert '<script type="module" src="/page/main.js">' in response.text


def test_every_file_it_names_is_served_with_its_type(client: TestClient) -> None:
    html = client.get("/").text
    named = re.findall(r'(?:src|href)="(/page/[^"]+)"', html)
    assert {"/page/main.js", "/page/style.css"} <= set(named)
    modules = [path for path in named if path.endswith(".js")]
    for path in named:
        response = client.get(path)
        assert response.status_code == 200, path
    # Each module's own imports resolve too (relative, same folder).
    for module in modules:
        for imported in re.findall(r'from "\./([^"]+)"', client.get(module).text):
            response = client.get(f"/page/{imported}")
            assert response.status_code == 200, imported
            assert response.headers["content-type"].startswith("text/javascript")


def test_nothing_is_loaded_from_outside() -> None:
    for path in STATIC.rglob("*"):
        if path.suffix in {".html", ".css", ".js"}:
            text = path.read_text()
            assert not re.search(r"(?:src|href|url\()\s*=?\s*[\"']?(?:https?:)?//", text), path
            assert not re.search(r"""(?:import|fetch)\s*\(?\s*["'](?:https?:)?//""", text), path


def test_the_examples_index_lists_the_bundled_configs(client: TestClient) -> None:
    index = client.get("/page/examples.json").json()
    on_disk = sorted(p.stem for p in (STATIC / "examples").glob("*.json"))
    assert [e["name"] for e in index] == on_disk
    assert len(on_disk) >= 3
    methods = set()
    for entry in index:
        config = client.get(entry["path"]).json()
        methods.add(config["quantization_config"]["quant_method"])
        # Each is a config the API decides (not an invalid row).
        answer = client.post("/v1/select", json={"config": config, "platform": "h200"})
        assert answer.status_code == 200, answer.text
    assert {"gptq", "awq", "compressed-tensors"} <= methods


def test_docs_fleet_examples_are_these_files() -> None:
    fleet = ROOT / "docs" / "examples" / "fleet"
    assert fleet.resolve() == (STATIC / "examples").resolve()


def test_no_request_path_reaches_the_file_system(client: TestClient) -> None:
    for path in (
        "/page/../page.py",
        "/page/%2e%2e/page.py",
        "/page/..%2fpage.py",
        "/page/examples/../../page.py",
        "/page/nothing.js",
        "/page/",
    ):
        response = client.get(path)
        assert response.status_code == 404, path
    assert "page.py" not in page_files()


def test_the_page_is_public_while_the_api_needs_the_token() -> None:
    test_client, _ = make_client(Settings(auth_token=TOKEN))
    with test_client:
        assert test_client.get("/").status_code == 200
        assert test_client.get("/page/main.js").status_code == 200
        assert test_client.get("/v1/platforms").status_code == 401
        authorized = {"Authorization": f"Bearer {TOKEN}"}
        assert test_client.get("/v1/platforms", headers=authorized).status_code == 200


def _sample(text: str, name: str, labels: str) -> float:
    prefix = f"{name}{{{labels}}} "
    line = next(line for line in text.splitlines() if line.startswith(prefix))
    return float(line[len(prefix) :])


def test_page_requests_are_counted_under_their_route() -> None:
    test_client, metrics = make_client()
    requests = "moe_control_http_requests_total"
    index = f'code="200",method="GET",route="{INDEX_ROUTE}"'
    assert _sample(metrics.exposition().decode(), requests, index) == 0
    with test_client:
        test_client.get("/")
        test_client.get("/page/main.js")
        test_client.get("/page/missing.js")
    text = metrics.exposition().decode()
    assert _sample(text, requests, index) == 1
    assert _sample(text, requests, f'code="200",method="GET",route="{FILE_ROUTE}"') == 1
    assert _sample(text, requests, f'code="404",method="GET",route="{FILE_ROUTE}"') == 1


def test_every_page_file_is_package_data() -> None:
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    patterns = pyproject["tool"]["setuptools"]["package-data"]["service.http"]
    for path in STATIC.rglob("*"):
        if path.is_file() and "__pycache__" not in path.parts:
            relative = path.relative_to(STATIC.parent).as_posix()
            assert any(fnmatch.fnmatch(relative, p) for p in patterns), relative
