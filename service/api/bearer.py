"""The bearer-token check both doors run: gRPC metadata `authorization: Bearer <token>` and
the HTTP header `Authorization: Bearer <token>` carry the token the same way, and either
door asks this one object whether a request carries the server's token.

The token is kept only as its SHA-256 digest, and a presented token is compared digest to
digest with `hmac.compare_digest`, so the comparison takes the same time whatever it
holds and however long it is.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


class BearerToken:
    """The server's token; `accepts` says whether a request's authorization values hold it."""

    def __init__(self, token: str) -> None:
        self._digest = _digest(token)

    def accepts(self, authorizations: Iterable[str]) -> bool:
        """Whether the first `Bearer <token>` among a request's authorization values (other
        schemes are passed over) is the server's token."""
        for value in authorizations:
            scheme, _, token = value.partition(" ")
            token = token.strip()
            if scheme.lower() == "bearer" and token:
                return hmac.compare_digest(_digest(token), self._digest)
        return False
