"""The HTTP door's metrics (declared in service.metrics with the others): every answered
request counted by method, route template and HTTP status code, and timed by method and
route. A path that matches no route is counted under the route "unmatched" (labels stay
bounded whatever clients send). The label children are resolved once each and kept (a
request then costs one increment and one observation, no label lookup)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from service.metrics import Metrics

UNMATCHED = "unmatched"


class Observer:
    def __init__(self, metrics: Metrics, routes: Iterable[tuple[str, str]]) -> None:
        self._metrics = metrics
        metrics.prepare_http(routes)
        self._counters: dict[tuple[str, str, int], Any] = {}
        self._timers: dict[tuple[str, str], Any] = {}

    def record(self, method: str, route: str, status: int, seconds: float) -> None:
        counter = self._counters.get((method, route, status))
        if counter is None:
            counter = self._metrics.http_requests.labels(method, route, str(status))
            self._counters[(method, route, status)] = counter
        counter.inc()
        timer = self._timers.get((method, route))
        if timer is None:
            timer = self._timers[(method, route)] = self._metrics.http_request_seconds.labels(
                method, route
            )
        timer.observe(seconds)
