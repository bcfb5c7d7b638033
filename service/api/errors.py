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
| ConvertResourceError           | RESOURCE_EXHAUSTED  | none                                     |
| RunInputError (RunMoE)         | INVALID_ARGUMENT    | BadRequest (the field), ErrorInfo        |
| RunResourceError (RunMoE)      | RESOURCE_EXHAUSTED  | BadRequest (the field), ErrorInfo        |
| BackendUnavailableError        | FAILED_PRECONDITION | PreconditionFailure (type=backend)       |
| WorkerNotFoundError            | NOT_FOUND           | ResourceInfo (worker)                    |
| LayerNotFoundError             | NOT_FOUND           | ResourceInfo (layer)                     |
| WorkerUnavailableError         | UNAVAILABLE         | RetryInfo (1 s)                          |
| NotImplementedError            | UNIMPLEMENTED       | its message says what is missing         |
| UnauthenticatedError           | UNAUTHENTICATED     | none                                     |
| anything else                  | INTERNAL            | none; a fixed message (logged in full)   |
"""

from __future__ import annotations

from google.protobuf import any_pb2, duration_pb2
from google.protobuf.message import Message
from google.rpc import code_pb2, error_details_pb2, status_pb2

from service.api import codec
from service.formats.input_errors import ConvertInputError, ConvertResourceError
from service.formats.paths import PermissionDeniedError
from service.oracle import InvalidSpecError, OracleError, SelectionError
from service.worker.errors import (
    BackendUnavailableError,
    LayerNotFoundError,
    RunInputError,
    RunResourceError,
    WorkerNotFoundError,
    WorkerUnavailableError,
)


class UnauthenticatedError(Exception):
    """The call lacks the bearer token the server requires."""


#: `ErrorInfo.domain` of every error this service raises.
ERROR_DOMAIN = "moe-control"
INTERNAL_MESSAGE = "internal error (the server log has the details)"


def _status(code: int, message: str, *details: Message) -> status_pb2.Status:
    packed = []
    for detail in details:
        holder = any_pb2.Any()
        holder.Pack(detail)
        packed.append(holder)
    return status_pb2.Status(code=code, message=message, details=packed)


def _error_info(reason: str, **metadata: str) -> error_details_pb2.ErrorInfo:
    return error_details_pb2.ErrorInfo(reason=reason, domain=ERROR_DOMAIN, metadata=metadata)


def _bad_request(field: str, description: str) -> error_details_pb2.BadRequest:
    return error_details_pb2.BadRequest(
        field_violations=[
            error_details_pb2.BadRequest.FieldViolation(field=field, description=description)
        ]
    )


def status_for(exc: BaseException) -> status_pb2.Status:
    """The status (with details) a domain exception maps to."""
    if isinstance(exc, InvalidSpecError):
        bad_request = error_details_pb2.BadRequest(
            field_violations=[
                error_details_pb2.BadRequest.FieldViolation(
                    field=v.field, description=v.description
                )
                for v in exc.violations
            ]
        )
        return _status(
            code_pb2.INVALID_ARGUMENT,
            f"invalid deployment: {exc}",
            bad_request,
            _error_info("INVALID_DEPLOYMENT_SPEC"),
        )
    if isinstance(exc, SelectionError):
        precondition = error_details_pb2.PreconditionFailure(
            violations=[
                error_details_pb2.PreconditionFailure.Violation(
                    type=c.backend, subject=c.reason_code, description=c.reason
                )
                for c in exc.candidates
            ]
        )
        info = _error_info(
            "BACKEND_SELECTION_FAILED", stage=exc.error.stage, vllm_exception=exc.error.type
        )
        return _status(
            code_pb2.FAILED_PRECONDITION,
            f"vLLM would fail this deployment ({exc.error.stage}): "
            f"{exc.error.type}: {exc.error.message}",
            precondition,
            info,
            codec.selection_failure_to_pb(exc),
        )
    if isinstance(exc, OracleError):
        return _status(code_pb2.INVALID_ARGUMENT, str(exc), _error_info(type(exc).__name__.upper()))
    if isinstance(exc, ConvertInputError):
        return _status(
            code_pb2.INVALID_ARGUMENT,
            str(exc),
            _bad_request(exc.field, exc.description),
            _error_info("INVALID_CONVERT_INPUT", field=exc.field),
        )
    if isinstance(exc, PermissionDeniedError):
        return _status(
            code_pb2.PERMISSION_DENIED,
            str(exc),
            _bad_request(exc.field, exc.reason),
            _error_info("PATH_NOT_ALLOWED", field=exc.field),
        )
    if isinstance(exc, RunInputError):
        return _status(
            code_pb2.INVALID_ARGUMENT,
            str(exc),
            _bad_request(exc.field, exc.description),
            _error_info("INVALID_RUN_MOE_INPUT", field=exc.field),
        )
    if isinstance(exc, RunResourceError):
        return _status(
            code_pb2.RESOURCE_EXHAUSTED,
            str(exc),
            _bad_request(exc.field, exc.description),
            _error_info("RUN_MOE_LIMIT", field=exc.field),
        )
    if isinstance(exc, BackendUnavailableError):
        return _status(
            code_pb2.FAILED_PRECONDITION,
            str(exc),
            error_details_pb2.PreconditionFailure(
                violations=[
                    error_details_pb2.PreconditionFailure.Violation(
                        type="backend", subject=exc.backend, description=exc.description
                    )
                ]
            ),
        )
    if isinstance(exc, ConvertResourceError):
        return _status(code_pb2.RESOURCE_EXHAUSTED, str(exc))
    if isinstance(exc, WorkerNotFoundError):
        return _status(
            code_pb2.NOT_FOUND,
            str(exc),
            error_details_pb2.ResourceInfo(
                resource_type="worker", resource_name=str(exc.index), description=str(exc)
            ),
        )
    if isinstance(exc, LayerNotFoundError):
        return _status(
            code_pb2.NOT_FOUND,
            str(exc),
            error_details_pb2.ResourceInfo(
                resource_type="layer", resource_name=exc.layer_id, description=str(exc)
            ),
        )
    if isinstance(exc, WorkerUnavailableError):
        return _status(
            code_pb2.UNAVAILABLE,
            str(exc),
            error_details_pb2.RetryInfo(retry_delay=duration_pb2.Duration(seconds=1)),
        )
    if isinstance(exc, UnauthenticatedError):
        return _status(code_pb2.UNAUTHENTICATED, str(exc))
    if isinstance(exc, NotImplementedError):
        return _status(code_pb2.UNIMPLEMENTED, str(exc) or "not implemented")
    return _status(code_pb2.INTERNAL, INTERNAL_MESSAGE)
