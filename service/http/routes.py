"""The route table of the HTTP/JSON API: each route once, with what the OpenAPI document
says of it (schemas by name from schemas.py) and what the endpoint applies to it (the gRPC
method whose concurrency limit it shares, whether it needs the token).

RunMoE and ConvertWeights are not here: they stream tensors and stay gRPC-only
(docs/http.md).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from service.http import handlers
from service.http.handlers import Call, Plane

Handler = Callable[[Plane, Call], Awaitable[Any]]


@dataclass(frozen=True, slots=True)
class Route:
    method: str
    path: str
    handler: Handler
    summary: str
    #: The answer's schema (schemas.SCHEMAS), and the body's for a POST.
    response: str
    request: str | None = None
    #: The gRPC method whose concurrency limit class the route shares (limits.py).
    limit: str | None = None
    #: Answered without the token (the probes).
    public: bool = False
    #: Query parameters: name -> description.
    query: tuple[tuple[str, str], ...] = ()
    #: The error statuses it may answer besides auth's, the body's and the limits'.
    errors: tuple[int, ...] = ()


async def openapi(plane: Plane, call: Call) -> Any:
    """GET /v1/openapi.json: the document (built by the app from this table)."""
    return plane.document


ROUTES: tuple[Route, ...] = (
    Route(
        "POST",
        "/v1/select",
        handlers.select,
        "Which WNA16 MoE backend vLLM picks for a deployment, and why every other lost "
        "(`moe-control select --json`)",
        "SelectAnswer",
        request="DeploymentSpec",
        limit="SelectBackend",
        errors=(400, 404, 503, 504),
    ),
    Route(
        "POST",
        "/v1/select:matrix",
        handlers.select_matrix,
        "Models x GPUs x rulesets, each cell the backend vLLM picks, hazards marked",
        "Matrix",
        request="MatrixRequest",
        limit="SelectBackend",
        errors=(400, 504),
    ),
    Route(
        "POST",
        "/v1/diff",
        handlers.diff,
        "What changes for a deployment from one ruleset (vLLM release) to another, and the "
        "rule or priority that moves it (`moe-control diff --json`)",
        "Diff",
        request="DiffRequest",
        limit="DiffRulesets",
        errors=(400, 503, 504),
    ),
    Route("GET", "/v1/platforms", handlers.platforms, "The GPU presets", "Presets"),
    Route(
        "GET",
        "/v1/rulesets",
        handlers.rulesets,
        "The rulesets, one per vLLM release; which is the default",
        "Rulesets",
    ),
    Route(
        "GET",
        "/v1/workers",
        handlers.workers,
        "The workers: device, state, kept layers",
        "Workers",
        errors=(503,),
    ),
    Route(
        "GET",
        "/v1/layers",
        handlers.layers,
        "The layers the workers keep for RunMoE",
        "Layers",
        query=(("worker_index", "only this worker's"),),
        errors=(400, 404, 503),
    ),
    Route(
        "GET",
        "/v1/observed",
        handlers.observed,
        "The decisions vLLM processes reported (the plugin), each with the server's own "
        "answer for it (`moe-control observed --json`)",
        "Observed",
        query=(("mismatches", "true: only those the server's answer differs from"),),
        errors=(400,),
    ),
    Route("GET", "/v1/openapi.json", openapi, "This document", "OpenApi"),
    Route("GET", "/healthz", handlers.healthz, "Liveness", "Health", public=True),
    Route(
        "GET",
        "/readyz",
        handlers.readyz,
        "Readiness, as gRPC health says it (503 while no worker is ready)",
        "Health",
        public=True,
        errors=(503,),
    ),
)
