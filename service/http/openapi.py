"""The OpenAPI 3.1 document, generated from the route table (routes.py) and the schemas
(schemas.py): nothing in it is written twice. Served at /v1/openapi.json and checked in
as docs/openapi.json (`python -m service.http.openapi` rewrites it; a test fails when it
drifts)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from service import __version__
from service.http.routes import ROUTES, Route
from service.http.schemas import SCHEMAS, ref

#: Where the checked-in copy lives, from the repository root.
CHECKED_IN = Path("docs") / "openapi.json"

_ERRORS = {
    400: "INVALID_ARGUMENT (bad JSON or spec, the fields named) or FAILED_PRECONDITION "
    "(vLLM would fail the deployment: per-backend reasons)",
    401: "UNAUTHENTICATED: a token is configured and the request lacks it",
    404: "NOT_FOUND: an unknown worker or layer",
    413: "the body is over max_receive_message_bytes (the limit named)",
    429: "RESOURCE_EXHAUSTED: the method's concurrency limit is full",
    503: "UNAVAILABLE: no worker ready (retry)",
    504: "DEADLINE_EXCEEDED: the work ran past the server's --cpu-budget-s",
}


def _error(status: int) -> dict[str, Any]:
    return {
        "description": _ERRORS[status],
        "content": {"application/json": {"schema": ref("Error")}},
    }


def _operation(route: Route) -> dict[str, Any]:
    name = route.path.strip("/").replace("/", "_").replace(":", "_").replace(".", "_")
    op: dict[str, Any] = {
        "operationId": f"{route.method.lower()}_{name}",
        "summary": route.summary,
        "responses": {
            "200": {
                "description": "OK",
                "content": {"application/json": {"schema": ref(route.response)}},
            }
        },
    }
    statuses = set(route.errors)
    if route.request is not None:
        op["requestBody"] = {
            "required": True,
            "content": {"application/json": {"schema": ref(route.request)}},
        }
        statuses |= {400, 413}
    if route.limit is not None:
        statuses.add(429)
    if route.public:
        op["security"] = []
    else:
        statuses.add(401)
    if route.query:
        op["parameters"] = [
            {
                "name": name,
                "in": "query",
                "required": False,
                "description": text,
                "schema": {"type": "integer", "minimum": 0},
            }
            for name, text in route.query
        ]
    for status in sorted(statuses):
        if route.path == "/readyz" and status == 503:
            op["responses"]["503"] = {
                "description": "NOT_SERVING",
                "content": {"application/json": {"schema": ref("Health")}},
            }
        else:
            op["responses"][str(status)] = _error(status)
    return op


def document() -> dict[str, Any]:
    """The whole document."""
    paths: dict[str, dict[str, Any]] = {}
    for route in ROUTES:
        paths.setdefault(route.path, {})[route.method.lower()] = _operation(route)
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "moe-control HTTP/JSON API",
            "version": __version__,
            "description": "vLLM's WNA16 MoE backend decision over HTTP/JSON: the same data "
            "plane as the moe_control.v1 gRPC API (docs/http.md). RunMoE and ConvertWeights "
            "are gRPC-only.",
        },
        "paths": paths,
        "components": {
            "schemas": SCHEMAS,
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
        "security": [{"bearer": []}],
    }


def render() -> str:
    return json.dumps(document(), indent=2, sort_keys=False) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Write docs/openapi.json (or the path given)."""
    args = sys.argv[1:] if argv is None else argv
    target = Path(args[0]) if args else CHECKED_IN
    target.write_text(render())
    print(f"wrote {target}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
