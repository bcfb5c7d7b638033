"""Bearer-token auth, gRPC's check (`service.api.bearer`) on the HTTP header: with a token
configured (`--auth-token` / `--auth-token-file`, the same settings), a request must carry
`Authorization: Bearer <token>`, else it is answered 401 UNAUTHENTICATED before anything
else runs for it. The probes (/healthz, /readyz) are exempt, as gRPC health is.
"""

from __future__ import annotations

from service.api.bearer import BearerToken
from service.api.errors import UnauthenticatedError

DENY = "missing or wrong bearer token (header 'Authorization: Bearer <token>')"


class BearerCheck:
    """Whether a request's Authorization header carries the server's token."""

    def __init__(self, token: str | None) -> None:
        self._token = None if token is None else BearerToken(token)

    @property
    def enabled(self) -> bool:
        return self._token is not None

    def check(self, header: str | None) -> None:
        """Raises UnauthenticatedError unless `header` is `Bearer <the token>` (or no token
        is configured)."""
        if self._token is None:
            return
        if not self._token.accepts(() if header is None else (header,)):
            raise UnauthenticatedError(DENY)
