"""Every error the formats layer raises on purpose, in one torch-free module.

The server process checks conversion input (streamed tensors, paths, names) without
importing torch, and the API's error table (`service.api.errors`) maps these classes to gRPC
statuses, so they live apart from the torch code that raises most of them. Each derives from
`service.errors.MoeControlError`; the ones that describe bad input keep their `ValueError`
mixin, which callers catch.

* `ConvertInputError`: a conversion request's input is wrong (INVALID_ARGUMENT, `field`
  named); `ConvertLimitError` is the same over a configured size limit (RESOURCE_EXHAUSTED).
* `StreamError` / `StreamLimitError`: a chunk stream that does not match its declaration.
* `InvalidPathError`: a path that is not a path; `PermissionDeniedError`: one that would
  leave the data root (PERMISSION_DENIED).
* `ConvertCancelledError`, `ConvertResourceError`: the caller cancelled; no room (segments,
  disk).
* `FormatError`: a tensor without the dtype, shape or values its layout requires.
* `ConversionUnsupported`: the target backend has no writer here (UNIMPLEMENTED).
"""

from __future__ import annotations

from service.errors import MoeControlError

__all__ = [
    "ConversionUnsupported",
    "ConvertCancelledError",
    "ConvertInputError",
    "ConvertLimitError",
    "ConvertResourceError",
    "FormatError",
    "InvalidPathError",
    "PermissionDeniedError",
    "StreamError",
    "StreamLimitError",
]


class ConvertInputError(MoeControlError, ValueError):
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


class ConvertCancelledError(MoeControlError):
    """The caller cancelled the conversion; whatever it had made is already removed."""


class ConvertResourceError(MoeControlError):
    """The server has no room for a conversion (tensor segments, disk): RESOURCE_EXHAUSTED."""


class StreamError(ConvertInputError):
    """A chunk stream that does not match its declaration (INVALID_ARGUMENT, field named)."""


class StreamLimitError(StreamError, ConvertLimitError):
    """A declared stream over the server's size limit (RESOURCE_EXHAUSTED, field and
    limit named)."""


class PermissionDeniedError(MoeControlError):
    """A path leaves the data root (or path mode is off). `field` names the request field."""

    def __init__(self, field: str, path: str, reason: str) -> None:
        self.field = field
        self.path = path
        self.reason = reason
        super().__init__(f"{field}: {path!r} is not allowed: {reason}")


class InvalidPathError(ConvertInputError):
    """A path that is not a path at all (empty, a NUL byte)."""


class FormatError(MoeControlError, ValueError):
    """A tensor does not have the dtype, shape or values its declared layout requires.

    `field` names the offending tensor (or parameter) so the API can report it.
    """

    def __init__(self, field: str, message: str) -> None:
        self.field = field
        self.description = message
        super().__init__(f"{field}: {message}")


class ConversionUnsupported(MoeControlError):  # noqa: N818 - a domain name, like FormatError
    """This backend has no writer here (or not for this layer); `reason` says why.

    The API maps it to UNIMPLEMENTED; it is about the target, never about bad input.
    """

    def __init__(self, backend: str, reason: str) -> None:
        self.backend = backend
        self.reason = reason
        super().__init__(f"{backend}: {reason}")
