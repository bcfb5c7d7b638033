"""Bearer-token auth: a call must carry `authorization: Bearer <token>` with the server's
token (`service.api.bearer`, the check the HTTP door runs too); otherwise it ends
UNAUTHENTICATED before anything else of the server runs for it.

Installed only when a token is configured. Health is exempt, so Kubernetes probes and load
balancers need no credentials. The refusal is the status the error table
(`service.api.errors`) gives `UnauthenticatedError`, built once.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from grpc_status import rpc_status

from service.api.bearer import BearerToken
from service.api.errors import UnauthenticatedError, status_for
from service.api.interceptors.handlers import Context, Method, Stream, Unary

HEALTH_SERVICE = "grpc.health.v1.Health"
#: Services callable without a token.
AUTH_EXEMPT_SERVICES = frozenset({HEALTH_SERVICE})

DENY = "missing or wrong bearer token (metadata 'authorization: Bearer <token>')"


class BearerAuth:
    """Refuses calls that lack the token (every service but the exempt ones)."""

    def __init__(self, token: str) -> None:
        self._token = BearerToken(token)
        self._denied = rpc_status.to_status(status_for(UnauthenticatedError(DENY)))

    def authorized(self, context: Context) -> bool:
        return self._token.accepts(
            value
            for key, value in context.invocation_metadata() or ()
            if key == "authorization" and isinstance(value, str)
        )

    def unary(self, method: Method, inner: Unary) -> Unary:
        if method.service in AUTH_EXEMPT_SERVICES:
            return inner
        authorized, denied = self.authorized, self._denied

        async def checked(request: Any, context: Context) -> Any:
            if not authorized(context):
                await context.abort_with_status(denied)
            return await inner(request, context)

        return checked

    def stream(self, method: Method, inner: Stream) -> Stream:
        if method.service in AUTH_EXEMPT_SERVICES:
            return inner
        authorized, denied = self.authorized, self._denied

        async def checked(request: Any, context: Context) -> AsyncIterator[Any]:
            if not authorized(context):
                await context.abort_with_status(denied)
            async for item in inner(request, context):
                yield item

        return checked
