"""SelectBackend from the client side, for `moe-control select --server`.

`remote_select` sends a deployment spec to a server and returns exactly the JSON object the
local `moe-control select --json` prints (the platform decided for included), plus
"server_platform" (the serving worker's profile). Failures raise `RemoteSelectionError`,
whose `result` has the local CLI's error shapes: `{"invalid": [...]}` for bad input, the
oracle's `SelectionError.to_json()` when vLLM would fail the deployment,
`{"error": {"stage": "server", ...}}` for transport errors (DEADLINE_EXCEEDED among them:
`RemoteSelectionError.code` says which).

The call goes through a `service.client.channel.Session`: its deadline is the whole command's
(a matrix or a JSON Lines file asks many questions in one session), and an UNAVAILABLE answer
carrying the server's RetryInfo is retried (SelectBackend is idempotent).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import grpc
from grpc_status import rpc_status

from service.api.codecs import matrix as matrix_codec
from service.api.codecs import selection as codec
from service.api.generated.moe_control.v1 import moe_control_service_pb2 as pb
from service.api.generated.moe_control.v1 import selection_pb2
from service.client.channel import Connection, Session
from service.client.errors import RemoteSelectionError
from service.client.exits import EXIT_BAD_INPUT, EXIT_SELECTION_FAILED, EXIT_SERVER_ERROR
from service.dataplane.matrix import Cell


def remote_failure(error: grpc.RpcError) -> RemoteSelectionError:
    """A failed call as the error the CLI reports: its result in the local shapes, its
    exit status."""
    call: Any = error  # a grpc.Call as well
    code: grpc.StatusCode = call.code()
    status = rpc_status.from_call(call)
    details = list(status.details) if status is not None else []
    if code is grpc.StatusCode.FAILED_PRECONDITION:
        for detail in details:
            failure = selection_pb2.SelectionFailure()
            if detail.Unpack(failure):
                result = codec.selection_error_from_pb(failure).to_json()
                return RemoteSelectionError(code, result, EXIT_SELECTION_FAILED)
    if code is grpc.StatusCode.INVALID_ARGUMENT:
        from google.rpc import error_details_pb2

        for detail in details:
            bad = error_details_pb2.BadRequest()
            if detail.Unpack(bad):
                invalid = [
                    {"field": v.field, "description": v.description} for v in bad.field_violations
                ]
                return RemoteSelectionError(code, {"invalid": invalid}, EXIT_BAD_INPUT)
    message = call.details() or code.name
    result = {"error": {"stage": "server", "type": code.name, "message": message}, "candidates": []}
    return RemoteSelectionError(code, result, EXIT_SERVER_ERROR)


def remote_select(
    server: str | Connection | Session,
    spec: Mapping[str, Any],
    *,
    token: str | None = None,
    tls_ca: str | Path | None = None,
    tls_cert: str | Path | None = None,
    tls_key: str | Path | None = None,
    ruleset: str = "",
    timeout: float | None = 30.0,
    measured: bool = False,
    token_counts: Sequence[int] = (),
    refresh: bool = False,
    measure_worker_index: int | None = None,
    what_would_change: bool = False,
) -> dict[str, Any]:
    """Ask the server for the decision on `spec` (a deployment spec object).

    `server`: an open `Session` (its deadline and retries apply; the CLI's way, one session
    for every question of a command), a `Connection` (a session is opened for this call) or
    HOST:PORT (a `Connection` from `token`, the `tls_*` files and `timeout`, which are
    ignored otherwise). A `Connection` with `wait_ready` may raise `ServerNotReadyError`.

    Without a "platform" in the spec, the server decides for its own worker's platform.
    "platform" is the platform the answer was decided for, "server_platform" the serving
    worker's own. `what_would_change`: the answer also says what would change it.
    `measured`: policy MEASURED (the serving worker times every backend it runs at each of
    `token_counts`; the server's defaults when empty); the answer gains "measured".
    """
    request = pb.SelectBackendRequest(
        spec_json=json.dumps(spec), ruleset=ruleset, what_would_change=what_would_change
    )
    if measured:
        from service.api.generated.moe_control.v1 import measured_pb2

        request.policy = measured_pb2.SELECTION_POLICY_MEASURED
        request.token_counts.extend(token_counts)
        request.refresh = refresh
        if measure_worker_index is not None:
            request.measure_worker_index = measure_worker_index
    if isinstance(server, Session):
        response = _call(server, request)
    else:
        connection = (
            server
            if isinstance(server, Connection)
            else Connection(
                server,
                token=token,
                tls_ca=tls_ca,
                tls_cert=tls_cert,
                tls_key=tls_key,
                timeout=timeout,
            )
        )
        with connection.session() as session:
            response = _call(session, request)
    result = codec.select_response_to_json(response)
    result["server_platform"] = (
        codec.profile_json(response.server_platform)
        if response.HasField("server_platform")
        else None
    )
    if response.HasField("measured"):
        result["measured"] = measured_to_json(response.measured)
    return result


def remote_matrix(
    session: Session,
    models: Sequence[tuple[str, str, Mapping[str, Any]]],
    gpus: Sequence[str],
    rulesets: Sequence[str],
    *,
    platform: Mapping[str, Any] | None = None,
) -> list[Cell]:
    """The matrix of `models` ((label, origin, deployment spec) each) by `gpus` by
    `rulesets` in one SelectMatrix call, every cell as `select --config` builds it locally
    (`platform`: what is laid over each GPU's preset, --packages and --env). Failures raise
    `RemoteSelectionError` (DEADLINE_EXCEEDED, UNIMPLEMENTED from an older server, ...)."""
    request = pb.SelectMatrixRequest(
        models=[
            pb.MatrixModel(label=label, origin=origin, spec_json=json.dumps(spec))
            for label, origin, spec in models
        ],
        gpus=list(gpus),
        rulesets=list(rulesets),
        platform_json=json.dumps(platform) if platform else "",
    )
    try:
        response = session.unary("SelectMatrix", request)
    except grpc.RpcError as error:
        raise remote_failure(error) from None
    return [matrix_codec.cell_from_pb(cell) for cell in response.cells]


def _call(session: Session, request: pb.SelectBackendRequest) -> Any:
    try:
        return session.unary("SelectBackend", request)
    except grpc.RpcError as error:
        raise remote_failure(error) from None


def measured_to_json(message: Any) -> dict[str, Any]:
    """A MeasuredSelection as plain JSON (seconds as floats; None where a backend did not
    run, with its reason in "error")."""

    def optional(holder: Any, name: str) -> float | None:
        return float(getattr(holder, name)) if holder.HasField(name) else None

    return {
        "worker_index": message.worker_index,
        "device_name": message.device_name,
        "from_cache": message.from_cache,
        "measured_time": (
            message.measured_time.ToJsonString() if message.HasField("measured_time") else None
        ),
        "measure_seconds": message.measure_seconds,
        "versions": dict(sorted(message.versions.items())),
        "buckets": [
            {
                "tokens": bucket.tokens,
                "fastest_backend": bucket.fastest_backend or None,
                "fastest_seconds": bucket.fastest_seconds if bucket.fastest_backend else None,
                "static_backend": bucket.static_backend or None,
                "static_seconds": optional(bucket, "static_seconds"),
                "speedup": optional(bucket, "speedup"),
                "timings": [
                    {
                        "backend": timing.backend,
                        "device_seconds": optional(timing, "device_seconds"),
                        "error": timing.error or None,
                    }
                    for timing in bucket.timings
                ],
            }
            for bucket in message.buckets
        ],
    }
