"""Bearer-token auth, as gRPC's (service.api.interceptors.auth): with a token configured
(`--auth-token` / `--auth-token-file`, the same settings), a request must carry
`Authorization: Bearer <token>`, compared in constant time (digests through
`hmac.compare_digest`), else it is answered 401 UNAUTHENTICATED before anything else runs
for it. The probes (/healthz, /readyz) are exempt, as gRPC health is.
"""

from __future__ import annotations

import hashlib
import hmac

from service.api.errors import UnauthenticatedError

DENY = "missing or wrong bearer token (header 'Authorization: Bearer <token>')"


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


class BearerCheck:
    """Whether a request's Authorization header carries the server's token."""

    def __init__(self, token: str | None) -> None:
        self._digest = None if token is None else _digest(token)

    @property
    def enabled(self) -> bool:
        return self._digest is not None

    def _matches(self, token: str) -> bool:
        return self._digest is not None and hmac.compare_digest(_digest(token), self._digest)

    def check(self, header: str | None) -> None:
        """Raises UnauthenticatedError unless `header` is `Bearer <the token>` (or no token
        is configured)."""
        if self._digest is None:
            return
        if header is not None:
            scheme, _, token = header.partition(" ")
            token = token.strip()
            if scheme.lower() == "bearer" and token and self._matches(token):
                return
        raise UnauthenticatedError(DENY)
