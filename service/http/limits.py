"""The HTTP door's limits, the same settings and meaning as gRPC's.

Body size: a body over `--max-receive-message-bytes` (gRPC's largest request message) is
refused with 413, the limit named, as soon as its declared length (Content-Length) or the
bytes received pass it; nothing more of it is read.

Concurrency: a route that does what a limited gRPC method does holds a slot of that method's
class for the whole request (POST /v1/select and /v1/select:matrix: SelectBackend's,
`--max-concurrent-select`), from the very `Limits` the primary's gRPC server holds, so
gRPC and HTTP calls share one budget per process; a full class refuses at once (or after
`--concurrency-wait-s`) with 429 RESOURCE_EXHAUSTED and the details gRPC gives
(service.api.interceptors.limits).
"""

from __future__ import annotations

from typing import Any

from service.api.interceptors.limits import SERVICE, Limit, Limits
from service.http.errors import BodyTooLargeError, bad_body


def method_limit(limits: Limits | None, method: str | None) -> Limit | None:
    """The Limit of a gRPC method's class (`method`: its short name), if it has one."""
    if limits is None or method is None:
        return None
    return limits.for_method(f"/{SERVICE}/{method}")


def full_name(method: str) -> str:
    return f"/{SERVICE}/{method}"


async def read_body(request: Any, limit: int) -> bytes:
    """The request's body, at most `limit` bytes (BodyTooLargeError past it)."""
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.isdigit():
            raise bad_body("Content-Length", f"not a length: {declared!r}")
        if int(declared) > limit:
            raise BodyTooLargeError(limit)
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise BodyTooLargeError(limit)
        chunks.append(chunk)
    return b"".join(chunks)
