"""One route's request pipeline, composed once per route when the app is built: the token
(unless the route is public), the body (at most the size limit; the handler parses it), a
slot of the route's gRPC method's limit class, the handler; every error answered in the one
JSON shape (errors.py), every answer counted and timed (observe.py)."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from service.api.interceptors.limits import Limits
from service.api.names import method_path
from service.http.auth import BearerCheck
from service.http.errors import error_json
from service.http.handlers import Call, Encoded, Plane, Reply
from service.http.limits import method_limit, read_body
from service.http.observe import Observer
from service.http.routes import Route

Endpoint = Callable[[Request], Awaitable[Response]]


@dataclass(frozen=True, slots=True)
class Door:
    """What every endpoint shares."""

    plane: Plane
    auth: BearerCheck
    limits: Limits | None
    max_body_bytes: int
    observer: Observer


def error_response(exc: BaseException) -> JSONResponse:
    status, body = error_json(exc)
    headers = {}
    if status == 401:
        headers["WWW-Authenticate"] = "Bearer"
    elif status in (429, 503):
        headers["Retry-After"] = "1"
    return JSONResponse(body, status, headers=headers)


def endpoint(route: Route, door: Door) -> Endpoint:
    limit = method_limit(door.limits, route.limit)
    method_name = method_path(str(route.limit))
    handler, plane, observer = route.handler, door.plane, door.observer
    check = None if route.public or not door.auth.enabled else door.auth.check
    has_body, max_body = route.request is not None, door.max_body_bytes

    async def serve(request: Request) -> Response:
        started = time.perf_counter()
        response: Response
        try:
            if check is not None:
                check(request.headers.get("authorization"))
            raw = await read_body(request, max_body) if has_body else b""
            call = Call(raw, request.query_params)
            if limit is None:
                result = await handler(plane, call)
            else:
                await limit.acquire(method_name)
                try:
                    result = await handler(plane, call)
                finally:
                    limit.release()
            if isinstance(result, Encoded):
                response = Response(result.payload, media_type="application/json")
            elif isinstance(result, Reply):
                response = JSONResponse(result.body, result.status)
            else:
                response = JSONResponse(result)
        except Exception as exc:
            response = error_response(exc)
        observer.record(
            route.method, route.path, response.status_code, time.perf_counter() - started
        )
        return response

    return serve
