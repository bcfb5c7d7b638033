"""Domain errors of the kernels.

They know nothing of gRPC: the worker reports them to the server, whose interceptor maps
them to status codes. Two families matter to callers:

* `KernelInputError`: the request is wrong for this layer (hidden size that does not match,
  a dtype the kernels do not take, expert ids out of range, NaN where validation was asked).
  It names the offending field, so the API can return a field violation; the worker stays
  healthy because nothing was launched.
* `KernelUnavailableError`: the backend cannot run here at all (no GPU for the Triton kernel
  and no interpreter, a layout it does not read). The worker reports such a backend as
  unavailable instead of substituting another one.
"""

from __future__ import annotations

from service.errors import MoeControlError


class KernelError(MoeControlError):
    """Base class of every error the kernels raise on purpose."""


class KernelInputError(KernelError, ValueError):
    """An input tensor or parameter does not fit the prepared layer; `field` names it."""

    def __init__(self, field: str, message: str) -> None:
        self.field = field
        self.description = message
        super().__init__(f"{field}: {message}")


class KernelUnavailableError(KernelError):
    """This backend cannot run on this device or for this layer; `backend` names it."""

    def __init__(self, backend: str, message: str) -> None:
        self.backend = backend
        self.description = message
        super().__init__(f"{backend}: {message}")
