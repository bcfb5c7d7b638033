"""Torch-free errors of conversion input, shared by the server process and the workers.

The server process assembles streamed tensors and checks paths without importing torch
(it stays small and never initialises a GPU runtime), so these cannot derive from
`canonical.FormatError` (whose module imports torch). The API maps `ConvertInputError` like
`FormatError`: INVALID_ARGUMENT with one BadRequest violation naming `field`.
"""

from __future__ import annotations


class ConvertInputError(ValueError):
    """A conversion request's input is wrong; `field` names the offending request field or
    tensor (e.g. ``tensors[w13_qweight].sha256``)."""

    def __init__(self, field: str, message: str) -> None:
        self.field = field
        self.description = message
        super().__init__(f"{field}: {message}")


class ConvertLimitError(ConvertInputError):
    """A conversion request over one of this server's configured size limits (`limit` names
    the setting): RESOURCE_EXHAUSTED, not INVALID_ARGUMENT, because the input may be
    well-formed and only too large for this server; the details name the field and the
    limit."""

    def __init__(self, field: str, message: str, limit: str) -> None:
        super().__init__(field, message)
        self.limit = limit


class ConvertCancelledError(Exception):
    """The caller cancelled the conversion; whatever it had made is already removed."""


class ConvertResourceError(Exception):
    """The server has no room for a conversion (tensor segments, disk): RESOURCE_EXHAUSTED."""
