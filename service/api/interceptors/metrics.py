"""The standard gRPC server metrics of every call: `grpc_server_started_total`,
`grpc_server_handled_total` (by code), `grpc_server_handling_seconds`, and for streaming
methods `grpc_server_msg_received_total` / `grpc_server_msg_sent_total`.

Every method's series exist from its registration (the methods are the ones the servicers
register, generated from their service descriptors), `grpc_server_handled_total` for every
status code among them. Outermost in the chain, so every end is counted under the code the
client sees: OK, the status of an abort (an error mapped by `status`, a refusal by `auth`,
a handler's own), CANCELLED. Streamed messages are counted next to the handler
(`messages`), so a call refused before its handler ran counted none, as before. Not
installed where the calls are counted by another process (the primary's private endpoint
for the replicas' calls).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc

from service.api.interceptors.handlers import Context, Method, Stream, Unary, code_name
from service.metrics import Metrics

_OK = grpc.StatusCode.OK.name
_CANCELLED = grpc.StatusCode.CANCELLED.name


#: Every status code a call can end with: each method's handled series are created for all
#: of them (as go-grpc-prometheus's InitializeMetrics does), so a method's first error is an
#: increase from zero, and error ratios have data before the first error.
CODES = tuple(code.name for code in grpc.StatusCode)


class MethodMetrics:
    """Label children of one method, resolved once, when the method is registered: so its
    series, every code's, are on /metrics at zero before its first call."""

    def __init__(self, metrics: Metrics, method: Method) -> None:
        labels = (method.grpc_type, method.service, method.name)
        self.started = metrics.grpc_started.labels(*labels)
        self.seconds = metrics.grpc_handling_seconds.labels(*labels)
        self.received = metrics.grpc_msg_received.labels(*labels)
        self.sent = metrics.grpc_msg_sent.labels(*labels)
        self._handled = metrics.grpc_handled
        self._labels = labels
        self._by_code: dict[str, Any] = {
            code: self._handled.labels(*labels, code) for code in CODES
        }

    def handled(self, code: str, seconds: float) -> None:
        child = self._by_code.get(code)
        if child is None:
            child = self._handled.labels(*self._labels, code)
            self._by_code[code] = child
        child.inc()
        self.seconds.observe(seconds)


class CallMetrics:
    """Counts each call of each method it wraps, and its streamed messages."""

    def __init__(self, metrics: Metrics) -> None:
        self._metrics = metrics
        self._by_method: dict[str, MethodMetrics] = {}

    def of(self, method: Method) -> MethodMetrics:
        stats = self._by_method.get(method.full_name)
        if stats is None:
            stats = self._by_method[method.full_name] = MethodMetrics(self._metrics, method)
        return stats

    def unary(self, method: Method, inner: Unary) -> Unary:
        stats = self.of(method)
        started, handled, clock = stats.started, stats.handled, time.perf_counter

        async def counted(request: Any, context: Context) -> Any:
            start = clock()
            started.inc()
            try:
                response = await inner(request, context)
            except asyncio.CancelledError:
                handled(_CANCELLED, clock() - start)
                raise
            except grpc.aio.AbortError:
                handled(code_name(context), clock() - start)
                raise
            handled(_OK, clock() - start)
            return response

        return counted

    def stream(self, method: Method, inner: Stream) -> Stream:
        stats = self.of(method)
        started, handled, clock = stats.started, stats.handled, time.perf_counter

        async def counted(request: Any, context: Context) -> AsyncIterator[Any]:
            start = clock()
            started.inc()
            try:
                async for item in inner(request, context):
                    yield item
            except asyncio.CancelledError:
                handled(_CANCELLED, clock() - start)
                raise
            except grpc.aio.AbortError:
                handled(code_name(context), clock() - start)
                raise
            handled(_OK, clock() - start)

        return counted

    def messages(self, method: Method, inner: Stream) -> Stream:
        """Count a streaming call's messages as the handler takes and gives them."""
        stats = self.of(method)
        received, sent = stats.received, stats.sent

        async def each(requests: AsyncIterator[Any]) -> AsyncIterator[Any]:
            async for item in requests:
                received.inc()
                yield item

        async def counted(request: Any, context: Context) -> AsyncIterator[Any]:
            if method.request_streaming:
                request = each(request)
            else:
                received.inc()
            async for item in inner(request, context):
                sent.inc()
                yield item

        return counted
