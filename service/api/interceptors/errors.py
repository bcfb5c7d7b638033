"""The errors the interceptors raise; `service.api.errors` maps them to statuses."""

from __future__ import annotations

from service.errors import MoeControlError


class UnauthenticatedError(MoeControlError):
    """The call lacks the bearer token the server requires: UNAUTHENTICATED."""


class ConcurrencyLimitError(MoeControlError):
    """A call found its method class's slots all taken: RESOURCE_EXHAUSTED, with details
    naming the method and the limit (the setting) so a client knows what to back off."""

    def __init__(self, method: str, limit: str, value: int) -> None:
        self.method = method
        self.limit = limit
        self.value = value
        super().__init__(
            f"{method} is at this server's limit of {value} concurrent calls "
            f"(setting {limit}); retry with backoff"
        )
