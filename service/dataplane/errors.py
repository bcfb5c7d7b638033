"""How a worker's error answer becomes the domain error the data plane raises.

A worker answers a failed job with a category and details (service/ipc/protocol.py);
the data plane turns it into the error of the layer the failure belongs to (a bad tensor
is a formats input error, a missing layer a pool error, an unwritable target an
unimplemented feature), so the API's one error table (service/api/errors.py) maps it like
the same error raised in this process. A category with no domain error stays the
WorkerCallError, which the table answers as INTERNAL.

The data plane raises the errors of the layers below it, and its own where a check is
its own: RunMoE's request checks (`RunInputError`, `RunResourceError`).
"""

from __future__ import annotations

from service.errors import MoeControlError
from service.formats.errors import ConvertInputError, ConvertResourceError, PermissionDeniedError
from service.oracle import FieldViolation, InvalidSpecError
from service.pool.errors import (
    BackendUnavailableError,
    LayerNotFoundError,
    WorkerCallError,
)


class RunInputError(MoeControlError, ValueError):
    """A RunMoE request that does not fit its layer or the contract; `field` names the
    request field (``hidden_states``, ``topk.topk_ids``, ``backend``...)."""

    def __init__(self, field: str, description: str) -> None:
        self.field = field
        self.description = description
        super().__init__(f"{field}: {description}")


class RunResourceError(MoeControlError):
    """A RunMoE request over a configured limit (tokens, inline bytes, layer budget);
    `field` names what is too large, `limit` the setting where it is known."""

    def __init__(self, field: str, description: str, limit: str = "") -> None:
        self.field = field
        self.description = description
        self.limit = limit
        super().__init__(f"{field}: {description}")


def conversion_error(exc: WorkerCallError) -> Exception:
    """The domain error a worker's answer to a conversion stands for (by its category)."""
    details = exc.details
    category = details.get("category")
    message = exc.message
    field = str(details.get("field", ""))
    description = str(details.get("description") or message.removeprefix(f"{field}: "))
    if category == "invalid_argument":
        return ConvertInputError(field or "tensors", description)
    if category == "permission_denied":
        return PermissionDeniedError(
            field or "checkpoint", str(details.get("path", "")), str(details.get("reason", message))
        )
    if category == "unimplemented":
        return NotImplementedError(message)
    if category == "invalid_spec":
        violations = [
            FieldViolation(str(v.get("field", "")), str(v.get("description", "")))
            for v in details.get("violations") or []
        ]
        return InvalidSpecError(violations or [FieldViolation(field, message)])
    if category == "resource_exhausted":
        return ConvertResourceError(message)
    return exc


def run_error(exc: WorkerCallError, layer_id: str = "") -> Exception:
    """The domain error a worker's answer to a run (or a measurement) stands for."""
    details = exc.details
    category = details.get("category")
    field = str(details.get("field", ""))
    description = str(details.get("description") or exc.message)
    if category == "invalid_argument":
        return RunInputError(field or "request", description)
    if category == "not_found":
        return LayerNotFoundError(layer_id)
    if category == "resource_exhausted":
        return RunResourceError(field or "request", description)
    if category == "backend_unavailable":
        return BackendUnavailableError(exc.message.split(":", 1)[0], description)
    if category == "unimplemented":
        return NotImplementedError(exc.message)
    return exc


class BudgetExceededError(MoeControlError):
    """CPU-heavy work (service.dataplane.offload) ran past its time budget: the server's
    `setting` (seconds), or the caller's own deadline where that came first."""

    def __init__(self, what: str, budget_s: float, setting: str) -> None:
        self.what = what
        self.budget_s = budget_s
        self.setting = setting
        super().__init__(
            f"{what} was not done within {budget_s:g} s (the smaller of the call's deadline "
            f"and the server's {setting}); ask for less at once"
        )
