"""The HTTP door's metrics (declared in service.metrics with the others): every answered
request counted by method, route template and HTTP status code, and timed by method and
route. A path that matches no route is counted under the route "unmatched" (labels stay
bounded whatever clients send)."""

from __future__ import annotations

from collections.abc import Iterable

from service.metrics import Metrics

UNMATCHED = "unmatched"


class Observer:
    def __init__(self, metrics: Metrics, routes: Iterable[tuple[str, str]]) -> None:
        self._metrics = metrics
        metrics.prepare_http(routes)

    def record(self, method: str, route: str, status: int, seconds: float) -> None:
        self._metrics.http_requests.labels(method, route, str(status)).inc()
        self._metrics.http_request_seconds.labels(method, route).observe(seconds)
