"""Domain exceptions -> gRPC status with `google.rpc.Status` details, in one table.

| exception                      | code                | details                                  |
| ------------------------------ | ------------------- | ---------------------------------------- |
| InvalidSpecError (+ ruleset)   | INVALID_ARGUMENT    | BadRequest (one violation per field)     |
| SelectionError                 | FAILED_PRECONDITION | PreconditionFailure (one per backend:    |
|                                |                     | type=backend, subject=reason code,       |
|                                |                     | description=vLLM's reason), ErrorInfo,   |
|                                |                     | moe_control.v1.SelectionFailure          |
| other OracleError              | INVALID_ARGUMENT    | ErrorInfo                                |
| ConvertInputError (StreamError | INVALID_ARGUMENT    | BadRequest (the field, e.g.              |
|   and path errors)             |                     | `tensors[w13_qweight].sha256`), ErrorInfo|
| PermissionDeniedError (paths)  | PERMISSION_DENIED   | BadRequest (the field), ErrorInfo        |
| ConvertLimitError (a size      | RESOURCE_EXHAUSTED  | BadRequest (the field), ErrorInfo        |
|   limit: convert_max_layer_bytes)|                   | CONVERT_LIMIT (field, limit), QuotaFailure|
| ConvertResourceError           | RESOURCE_EXHAUSTED  | none                                     |
| RunInputError (RunMoE)         | INVALID_ARGUMENT    | BadRequest (the field), ErrorInfo        |
| RunResourceError (RunMoE)      | RESOURCE_EXHAUSTED  | BadRequest (the field), ErrorInfo        |
|                                |                     | RUN_MOE_LIMIT (field, limit), QuotaFailure|
| BackendUnavailableError        | FAILED_PRECONDITION | PreconditionFailure (type=backend)       |
| WorkerNotFoundError            | NOT_FOUND           | ResourceInfo (worker)                    |
| LayerNotFoundError             | NOT_FOUND           | ResourceInfo (layer)                     |
| WorkerUnavailableError         | UNAVAILABLE         | RetryInfo (1 s)                          |
| NotImplementedError            | UNIMPLEMENTED       | its message says what is missing         |
| UnauthenticatedError           | UNAUTHENTICATED     | none                                     |
| ConcurrencyLimitError          | RESOURCE_EXHAUSTED  | QuotaFailure (subject=method,            |
|   (per-method limit, limits.py)|                     | description=the limit), ErrorInfo        |
|                                |                     | CONCURRENCY_LIMIT (method, limit, value),|
|                                |                     | RetryInfo (0.1 s)                        |
| anything else                  | INTERNAL            | none; a fixed message (logged in full)   |
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from google.protobuf import any_pb2, duration_pb2
from google.protobuf.message import Message
from google.rpc import code_pb2, error_details_pb2, status_pb2

from service.api.codecs import selection as codec
from service.dataplane.errors import BudgetExceededError, RunInputError, RunResourceError
from service.errors import MoeControlError
from service.formats.errors import (
    ConvertInputError,
    ConvertLimitError,
    ConvertResourceError,
    PermissionDeniedError,
)
from service.oracle import InvalidSpecError, OracleError, SelectionError
from service.pool.errors import (
    BackendUnavailableError,
    LayerNotFoundError,
    WorkerNotFoundError,
    WorkerUnavailableError,
)


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


#: `ErrorInfo.domain` of every error this service raises.
ERROR_DOMAIN = "moe-control"
INTERNAL_MESSAGE = "internal error (the server log has the details)"

Details = Callable[[Any], tuple[Message, ...]]


def pack_status(code: int, message: str, *details: Message) -> status_pb2.Status:
    """A `google.rpc.Status` with `details` packed as `Any` messages."""
    packed = []
    for detail in details:
        holder = any_pb2.Any()
        holder.Pack(detail)
        packed.append(holder)
    return status_pb2.Status(code=code, message=message, details=packed)


def _error_info(reason: str, **metadata: str) -> error_details_pb2.ErrorInfo:
    return error_details_pb2.ErrorInfo(reason=reason, domain=ERROR_DOMAIN, metadata=metadata)


def _bad_request(*violations: tuple[str, str]) -> error_details_pb2.BadRequest:
    return error_details_pb2.BadRequest(
        field_violations=[
            error_details_pb2.BadRequest.FieldViolation(field=field, description=description)
            for field, description in violations
        ]
    )


def _precondition(*violations: tuple[str, str, str]) -> error_details_pb2.PreconditionFailure:
    return error_details_pb2.PreconditionFailure(
        violations=[
            error_details_pb2.PreconditionFailure.Violation(
                type=kind, subject=subject, description=description
            )
            for kind, subject, description in violations
        ]
    )


def _field_error(reason: str, description: str = "description") -> Details:
    """The details of an error about one request field (`exc.field`; the text is the
    attribute named `description`): BadRequest naming it, and ErrorInfo."""

    def details(exc: Any) -> tuple[Message, ...]:
        return (
            _bad_request((exc.field, getattr(exc, description))),
            _error_info(reason, field=exc.field),
        )

    return details


def _size_limit(reason: str) -> Details:
    """The details of a request over a configured size limit: BadRequest naming the field,
    ErrorInfo naming the field and the limit (the setting), QuotaFailure (subject: the
    field) when the limit is known."""

    def details(exc: Any) -> tuple[Message, ...]:
        limit = getattr(exc, "limit", "")
        found: tuple[Message, ...] = (
            _bad_request((exc.field, exc.description)),
            _error_info(reason, field=exc.field, **({"limit": limit} if limit else {})),
        )
        if limit:
            quota = error_details_pb2.QuotaFailure(
                violations=[
                    error_details_pb2.QuotaFailure.Violation(
                        subject=exc.field, description=f"over the setting {limit}"
                    )
                ]
            )
            found += (quota,)
        return found

    return details


def _resource(kind: str, name: Callable[[Any], str]) -> Details:
    def details(exc: Any) -> tuple[Message, ...]:
        return (
            error_details_pb2.ResourceInfo(
                resource_type=kind, resource_name=name(exc), description=str(exc)
            ),
        )

    return details


def _invalid_spec(exc: InvalidSpecError) -> tuple[Message, ...]:
    violations = [(v.field, v.description) for v in exc.violations]
    return _bad_request(*violations), _error_info("INVALID_DEPLOYMENT_SPEC")


def _selection_failed(exc: SelectionError) -> tuple[Message, ...]:
    return (
        _precondition(*((c.backend, c.reason_code, c.reason) for c in exc.candidates)),
        _error_info(
            "BACKEND_SELECTION_FAILED", stage=exc.error.stage, vllm_exception=exc.error.type
        ),
        codec.selection_failure_to_pb(exc),
    )


def _selection_message(exc: SelectionError) -> str:
    return (
        f"vLLM would fail this deployment ({exc.error.stage}): "
        f"{exc.error.type}: {exc.error.message}"
    )


def _concurrency_limited(exc: ConcurrencyLimitError) -> tuple[Message, ...]:
    return (
        error_details_pb2.QuotaFailure(
            violations=[
                error_details_pb2.QuotaFailure.Violation(
                    subject=exc.method,
                    description=f"{exc.value} concurrent calls (setting {exc.limit})",
                )
            ]
        ),
        _error_info("CONCURRENCY_LIMIT", method=exc.method, limit=exc.limit, value=str(exc.value)),
        error_details_pb2.RetryInfo(retry_delay=duration_pb2.Duration(nanos=100_000_000)),
    )


def _no_details(exc: Any) -> tuple[Message, ...]:
    return ()


@dataclass(frozen=True, slots=True)
class Mapping:
    """One row of the table: what an exception of `exception`'s type becomes."""

    exception: type[BaseException]
    code: int
    details: Details = _no_details
    message: Callable[[Any], str] = str


#: Domain exception -> status, first match wins (subclasses come before their bases:
#: InvalidSpecError and SelectionError before OracleError). Anything not listed is INTERNAL.
MAPPINGS: tuple[Mapping, ...] = (
    Mapping(
        InvalidSpecError,
        code_pb2.INVALID_ARGUMENT,
        _invalid_spec,
        lambda exc: f"invalid deployment: {exc}",
    ),
    Mapping(SelectionError, code_pb2.FAILED_PRECONDITION, _selection_failed, _selection_message),
    Mapping(
        OracleError,
        code_pb2.INVALID_ARGUMENT,
        lambda exc: (_error_info(type(exc).__name__.upper()),),
    ),
    Mapping(ConvertLimitError, code_pb2.RESOURCE_EXHAUSTED, _size_limit("CONVERT_LIMIT")),
    Mapping(ConvertInputError, code_pb2.INVALID_ARGUMENT, _field_error("INVALID_CONVERT_INPUT")),
    Mapping(
        PermissionDeniedError,
        code_pb2.PERMISSION_DENIED,
        _field_error("PATH_NOT_ALLOWED", description="reason"),
    ),
    Mapping(RunInputError, code_pb2.INVALID_ARGUMENT, _field_error("INVALID_RUN_MOE_INPUT")),
    Mapping(RunResourceError, code_pb2.RESOURCE_EXHAUSTED, _size_limit("RUN_MOE_LIMIT")),
    Mapping(
        BackendUnavailableError,
        code_pb2.FAILED_PRECONDITION,
        lambda exc: (_precondition(("backend", exc.backend, exc.description)),),
    ),
    Mapping(ConvertResourceError, code_pb2.RESOURCE_EXHAUSTED),
    Mapping(WorkerNotFoundError, code_pb2.NOT_FOUND, _resource("worker", lambda e: str(e.index))),
    Mapping(LayerNotFoundError, code_pb2.NOT_FOUND, _resource("layer", lambda e: e.layer_id)),
    Mapping(
        WorkerUnavailableError,
        code_pb2.UNAVAILABLE,
        lambda exc: (error_details_pb2.RetryInfo(retry_delay=duration_pb2.Duration(seconds=1)),),
    ),
    Mapping(UnauthenticatedError, code_pb2.UNAUTHENTICATED),
    Mapping(
        BudgetExceededError,
        code_pb2.DEADLINE_EXCEEDED,
        lambda exc: (_error_info("CPU_BUDGET", limit=exc.setting, seconds=f"{exc.budget_s:g}"),),
    ),
    Mapping(ConcurrencyLimitError, code_pb2.RESOURCE_EXHAUSTED, _concurrency_limited),
    Mapping(
        NotImplementedError,
        code_pb2.UNIMPLEMENTED,
        message=lambda exc: str(exc) or "not implemented",
    ),
)


def status_for(exc: BaseException) -> status_pb2.Status:
    """The status (with details) a domain exception maps to: the first row of MAPPINGS
    whose type it is an instance of, else INTERNAL with a fixed message."""
    for row in MAPPINGS:
        if isinstance(exc, row.exception):
            return pack_status(row.code, row.message(exc), *row.details(exc))
    return pack_status(code_pb2.INTERNAL, INTERNAL_MESSAGE)
