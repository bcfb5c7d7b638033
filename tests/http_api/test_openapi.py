"""docs/openapi.json is exactly what the code generates (`make docs` rewrites it), and the
document covers every route, each schema it names declared."""

from __future__ import annotations

import json
from pathlib import Path

from service.http import openapi
from service.http.routes import ROUTES
from service.http.schemas import SCHEMAS

ROOT = Path(__file__).resolve().parents[2]


def test_checked_in_document_matches_the_code() -> None:
    checked_in = (ROOT / openapi.CHECKED_IN).read_text()
    assert checked_in == openapi.render(), (
        "docs/openapi.json drifted from service/http (run `make docs`, or "
        "`python -m service.http.openapi`)"
    )


def test_every_route_and_schema_is_in_it() -> None:
    document = openapi.document()
    for route in ROUTES:
        assert route.method.lower() in document["paths"][route.path]
    text = json.dumps(document)
    for ref in {part.split('"')[0] for part in text.split("#/components/schemas/")[1:]}:
        assert ref in SCHEMAS, ref
    assert not {r.path for r in ROUTES} & {"/v1/runmoe", "/v1/convert"}  # gRPC-only


def test_probes_need_no_token() -> None:
    paths = openapi.document()["paths"]
    assert paths["/healthz"]["get"]["security"] == []
    assert "401" in paths["/v1/select"]["post"]["responses"]
    assert "413" in paths["/v1/select"]["post"]["responses"]
