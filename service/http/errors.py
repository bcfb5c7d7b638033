"""Errors as JSON: one shape, derived from `google.rpc.Status`, for every failed request.

    {"error": {"code": 400, "status": "INVALID_ARGUMENT", "message": "...",
               "details": [{"@type": "type.googleapis.com/google.rpc.BadRequest",
                            "field_violations": [{"field": "layer.top_k", ...}]}, ...]}}

This is Google's JSON error form (AIP-193): `code` is the HTTP status, `status` the gRPC
code's name, `message` and `details` the status's own, each detail a packed message in
protobuf's JSON mapping (proto field names and every field, as the CLI's `--json` prints
messages). A domain
error gets the very status gRPC gives it, from the one table in `service.api.errors`
(field violations, per-backend PreconditionFailure, RetryInfo, ...); the HTTP status is
the gRPC-HTTP mapping's (`HTTP_STATUS`, as google.rpc.Code documents it). Only what gRPC
never meets has a row here: a body over the size limit (413), an unknown route (404), a
method a route does not take (405).
"""

from __future__ import annotations

import logging
from typing import Any

from google.protobuf import json_format
from google.rpc import code_pb2, error_details_pb2, status_pb2

from service.api.errors import ERROR_DOMAIN, pack_status, status_for
from service.errors import MoeControlError
from service.oracle import FieldViolation, InvalidSpecError

log = logging.getLogger("moe_control.http")

#: gRPC code -> HTTP status (google.rpc.Code's documented mapping).
HTTP_STATUS: dict[int, int] = {
    code_pb2.OK: 200,
    code_pb2.CANCELLED: 499,
    code_pb2.UNKNOWN: 500,
    code_pb2.INVALID_ARGUMENT: 400,
    code_pb2.DEADLINE_EXCEEDED: 504,
    code_pb2.NOT_FOUND: 404,
    code_pb2.ALREADY_EXISTS: 409,
    code_pb2.PERMISSION_DENIED: 403,
    code_pb2.UNAUTHENTICATED: 401,
    code_pb2.RESOURCE_EXHAUSTED: 429,
    code_pb2.FAILED_PRECONDITION: 400,
    code_pb2.ABORTED: 409,
    code_pb2.OUT_OF_RANGE: 400,
    code_pb2.UNIMPLEMENTED: 501,
    code_pb2.INTERNAL: 500,
    code_pb2.UNAVAILABLE: 503,
    code_pb2.DATA_LOSS: 500,
}


class BadBodyError(InvalidSpecError):
    """A request body that is not the JSON its route takes: INVALID_ARGUMENT (400), the
    field named (`body` when it is not JSON at all)."""


def bad_body(field: str, description: str) -> BadBodyError:
    """A BadBodyError naming one field."""
    return BadBodyError([FieldViolation(field, description)])


class BodyTooLargeError(MoeControlError):
    """A body over `max_receive_message_bytes`, gRPC's own message limit: 413."""

    SETTING = "max_receive_message_bytes"

    def __init__(self, limit: int) -> None:
        self.limit = limit
        super().__init__(f"request body over the limit of {limit} bytes (setting {self.SETTING})")


class NoRouteError(MoeControlError):
    """No route has this path: 404."""

    def __init__(self, path: str) -> None:
        self.path = path
        super().__init__(f"no such resource: {path} (GET /v1/openapi.json lists them)")


class MethodNotAllowedError(MoeControlError):
    """The route exists but takes other methods: 405."""

    def __init__(self, method: str, path: str, allowed: tuple[str, ...]) -> None:
        self.allowed = allowed
        super().__init__(f"{path} does not take {method}; it takes {', '.join(allowed)}")


class ForwardedStatusError(MoeControlError):
    """A call this process made to the primary failed (state.py): the primary's status,
    answered as it gave it."""

    def __init__(self, status: status_pb2.Status) -> None:
        self.status = status
        super().__init__(status.message)


def http_status_for(exc: BaseException) -> tuple[int, status_pb2.Status]:
    """The HTTP status and the `google.rpc.Status` a failed request answers with."""
    if isinstance(exc, BodyTooLargeError):
        info = error_details_pb2.ErrorInfo(
            reason="BODY_LIMIT",
            domain=ERROR_DOMAIN,
            metadata={"field": "body", "limit": exc.SETTING, "value": str(exc.limit)},
        )
        bad = error_details_pb2.BadRequest(
            field_violations=[
                error_details_pb2.BadRequest.FieldViolation(
                    field="body", description=f"at most {exc.limit} bytes"
                )
            ]
        )
        return 413, pack_status(code_pb2.RESOURCE_EXHAUSTED, str(exc), bad, info)
    if isinstance(exc, NoRouteError):
        resource = error_details_pb2.ResourceInfo(
            resource_type="route", resource_name=exc.path, description=str(exc)
        )
        return 404, pack_status(code_pb2.NOT_FOUND, str(exc), resource)
    if isinstance(exc, MethodNotAllowedError):
        return 405, pack_status(code_pb2.UNIMPLEMENTED, str(exc))
    if isinstance(exc, ForwardedStatusError):
        return HTTP_STATUS.get(exc.status.code, 500), exc.status
    status = status_for(exc)
    if status.code == code_pb2.INTERNAL:
        log.error("unhandled error in an HTTP request", exc_info=exc)
    return HTTP_STATUS.get(status.code, 500), status


def status_json(http_status: int, status: status_pb2.Status) -> dict[str, Any]:
    """The error body for a status."""
    return {
        "error": {
            "code": http_status,
            "status": code_pb2.Code.Name(status.code),
            "message": status.message,
            "details": [
                json_format.MessageToDict(
                    detail,
                    preserving_proto_field_name=True,
                    always_print_fields_with_no_presence=True,
                )
                for detail in status.details
            ],
        }
    }


def error_json(exc: BaseException) -> tuple[int, dict[str, Any]]:
    """The HTTP status and the JSON body of a request that raised `exc`."""
    http_status, status = http_status_for(exc)
    return http_status, status_json(http_status, status)
