"""The HTTP/JSON API's Starlette app: the route table (routes.py) wired to its endpoints
(endpoint.py), the what-if page's files beside them (page.py), and unknown paths and
methods answered in the same error shape. Wiring only: what a route does is its
handler's."""

from __future__ import annotations

import time
from dataclasses import replace

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route as StarletteRoute

from service.api.interceptors.limits import Limits
from service.http.auth import BearerCheck
from service.http.endpoint import Door, endpoint, error_response
from service.http.errors import MethodNotAllowedError, NoRouteError
from service.http.handlers import Plane
from service.http.observe import UNMATCHED, Observer
from service.http.openapi import document
from service.http.page import FILE_ROUTE, INDEX_ROUTE, page_routes
from service.http.routes import ROUTES
from service.metrics import Metrics
from service.settings import Settings

#: The method label of an unmatched request is one of these, else OTHER (bounded labels).
_METHODS = frozenset({"GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"})


def build_app(
    plane: Plane, settings: Settings, metrics: Metrics, limits: Limits | None = None
) -> Starlette:
    """The app over `plane`, with the token, size limit and `limits` (default: this
    door's own, from `settings`; the primary passes its gRPC server's, so both share them)."""
    if limits is None:
        limits = Limits.from_settings(settings, metrics)
    observer = Observer(
        metrics,
        [(route.method, route.path) for route in ROUTES]
        + [("GET", INDEX_ROUTE), ("GET", FILE_ROUTE)],
    )
    door = Door(
        plane=replace(plane, document=document()),
        auth=BearerCheck(settings.token()),
        limits=limits,
        max_body_bytes=settings.max_receive_message_bytes,
        observer=observer,
    )
    routes = [
        StarletteRoute(route.path, endpoint(route, door), methods=[route.method])
        for route in ROUTES
    ]
    routes.extend(page_routes(observer))
    allowed: dict[str, tuple[str, ...]] = {INDEX_ROUTE: ("GET",)}
    for route in ROUTES:
        allowed[route.path] = (*allowed.get(route.path, ()), route.method)

    async def unmatched(request: Request, exc: Exception) -> Response:
        started = time.perf_counter()
        status = exc.status_code if isinstance(exc, HTTPException) else 404
        path = request.url.path
        if status == 405:
            error: Exception = MethodNotAllowedError(request.method, path, allowed.get(path, ()))
        else:
            error = NoRouteError(path)
        response = error_response(error)
        if status == 405:
            response.headers["Allow"] = ", ".join(allowed.get(path, ()))
        method = request.method if request.method in _METHODS else "OTHER"
        observer.record(method, UNMATCHED, response.status_code, time.perf_counter() - started)
        return response

    return Starlette(routes=routes, exception_handlers={404: unmatched, 405: unmatched})
