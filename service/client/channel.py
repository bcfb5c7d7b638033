"""Channels to a moe-control server, the call metadata every client sends, and the calls
themselves: waiting for readiness and retrying what the server says to retry.

`Connection` says where the server is and how to reach it (TLS and mTLS when asked for, the
bearer token from the caller or the environment), how long the whole command may take
(`timeout`: the wait for readiness, the call and its retries together) and whether to wait
for readiness first. `Connection.session()` opens the channel (waiting when asked) and gives
a `Session` whose `unary` and `stream` call MoeControlService's methods under that one
deadline.

Retries: a call of a method in `IDEMPOTENT_METHODS` that fails UNAVAILABLE with a
`google.rpc.RetryInfo` in its status (the server sends one while a worker restarts) is tried
again after the delay the server asked for, at most `max_retries` times and never past the
deadline. UNAVAILABLE without RetryInfo (nothing listening, a broken connection) is not
retried: the server did not say it would recover, and a probe must fail fast
(`wait_ready` is the way to wait for a server that is starting).
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from service.api.generated.moe_control.v1 import moe_control_service_pb2 as pb
from service.api.generated.moe_control.v1 import moe_control_service_pb2_grpc as pb_grpc
from service.client.errors import ServerNotReadyError

#: Read when no token is passed (the same variable the server reads).
TOKEN_ENV = "MOE_CONTROL_AUTH_TOKEN"
#: The service whose grpc.health.v1 status is the server's readiness.
READINESS_SERVICE: str = pb.DESCRIPTOR.services_by_name["MoeControlService"].full_name
#: Methods a repeated call cannot harm: they read, decide or compute and change nothing a
#: second call would see differently. ConvertWeights (it writes files and keeps layers, and
#: its request stream cannot be replayed), UnloadLayer (a repeat answers NOT_FOUND) and
#: ReportDecisions (a repeat counts the report again) are not retried.
IDEMPOTENT_METHODS = frozenset(
    {
        "SelectBackend",
        "RunMoE",
        "GetPlatform",
        "ListPlatformPresets",
        "ListRulesets",
        "DiffRulesets",
        "SelectMatrix",
        "ListWorkers",
        "ListLayers",
        "ListObservedDecisions",
    }
)
#: Retries of one call, at most.
DEFAULT_MAX_RETRIES = 3
#: A server's RetryInfo delay longer than this is shortened to it.
MAX_RETRY_DELAY_S = 10.0
#: Room for a response chunk plus its message (ConvertWeights, RunMoE).
MESSAGE_LIMIT = 64 * 1024 * 1024


def _read(path: str | Path | None) -> bytes | None:
    return None if path is None else Path(path).read_bytes()


def open_channel(
    target: str,
    *,
    tls_ca: str | Path | None = None,
    tls_cert: str | Path | None = None,
    tls_key: str | Path | None = None,
    tls: bool | None = None,
    options: Sequence[tuple[str, Any]] = (),
) -> grpc.Channel:
    """A channel to `target` (HOST:PORT): TLS when a CA or client cert is given (or tls=True),
    with the client cert for mTLS."""
    use_tls = tls if tls is not None else any(p is not None for p in (tls_ca, tls_cert, tls_key))
    if not use_tls:
        return grpc.insecure_channel(target, options=options)
    credentials = grpc.ssl_channel_credentials(
        root_certificates=_read(tls_ca),
        private_key=_read(tls_key),
        certificate_chain=_read(tls_cert),
    )
    return grpc.secure_channel(target, credentials, options=options)


def call_metadata(token: str | None) -> Sequence[tuple[str, str]]:
    token = token if token is not None else os.environ.get(TOKEN_ENV)
    return (("authorization", f"Bearer {token}"),) if token else ()


def retry_delay(error: grpc.RpcError) -> float | None:
    """The delay an UNAVAILABLE answer's `google.rpc.RetryInfo` asks for, in seconds; None
    for any other answer (another code, or no RetryInfo in the status)."""
    from google.rpc import error_details_pb2
    from grpc_status import rpc_status

    call: Any = error  # a grpc.Call as well
    if call.code() is not grpc.StatusCode.UNAVAILABLE:
        return None
    try:
        status = rpc_status.from_call(call)
    except ValueError:  # a status whose details contradict its code: not the server's own
        return None
    for detail in status.details if status is not None else ():
        info = error_details_pb2.RetryInfo()
        if detail.Unpack(info):
            return float(info.retry_delay.ToTimedelta().total_seconds())
    return None


def wait_until_ready(
    channel: grpc.Channel, timeout: float | None, service: str = READINESS_SERVICE
) -> None:
    """Block until `service`'s health is SERVING (by default the server's readiness), for at
    most `timeout` seconds (None: as long as it takes); waits for the server to listen
    too. Raises `ServerNotReadyError` saying the last status seen."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    stub: Any = health_pb2_grpc.HealthStub(channel)
    names = health_pb2.HealthCheckResponse.ServingStatus
    last = "no answer (nothing listening)"
    began = time.monotonic()
    try:
        updates = stub.Watch(
            health_pb2.HealthCheckRequest(service=service), timeout=timeout, wait_for_ready=True
        )
        for update in updates:
            if update.status == health_pb2.HealthCheckResponse.SERVING:
                updates.cancel()
                return
            last = names.Name(update.status)
    except grpc.RpcError as error:
        call: Any = error
        if call.code() is not grpc.StatusCode.DEADLINE_EXCEEDED:
            last = f"{call.code().name}: {call.details() or 'no message'}"
    waited = time.monotonic() - began
    raise ServerNotReadyError(service, last, waited)


@dataclass(frozen=True, slots=True)
class Connection:
    """A server to call and how: `timeout` bounds the whole command (readiness wait, call,
    retries; None: no deadline), `wait_ready` waits for readiness before the first call."""

    server: str
    token: str | None = None
    tls_ca: str | Path | None = None
    tls_cert: str | Path | None = None
    tls_key: str | Path | None = None
    timeout: float | None = None
    wait_ready: bool = False
    max_retries: int = DEFAULT_MAX_RETRIES

    def open(self) -> grpc.Channel:
        """The channel alone (large messages allowed both ways)."""
        limits = [
            ("grpc.max_receive_message_length", MESSAGE_LIMIT),
            ("grpc.max_send_message_length", MESSAGE_LIMIT),
        ]
        return open_channel(
            self.server,
            tls_ca=self.tls_ca,
            tls_cert=self.tls_cert,
            tls_key=self.tls_key,
            options=limits,
        )

    def metadata(self) -> Sequence[tuple[str, str]]:
        return call_metadata(self.token)

    @contextmanager
    def session(self, ready_service: str = READINESS_SERVICE) -> Iterator[Session]:
        """An open channel (closed on exit), after `ready_service` is SERVING when
        `wait_ready` (by default the server's readiness)."""
        deadline = None if self.timeout is None else time.monotonic() + self.timeout
        with self.open() as channel:
            session = Session(self, channel, deadline)
            if self.wait_ready:
                wait_until_ready(channel, session.remaining(), ready_service)
            yield session


class Session:
    """MoeControlService calls on one channel, under one deadline."""

    def __init__(
        self, connection: Connection, channel: grpc.Channel, deadline: float | None
    ) -> None:
        self.connection = connection
        self.channel = channel
        self.deadline = deadline
        self.stub: Any = pb_grpc.MoeControlServiceStub(channel)  # type: ignore[no-untyped-call]

    def remaining(self) -> float | None:
        """Seconds left before the deadline (None: no deadline; never below a millisecond,
        so an expired one answers DEADLINE_EXCEEDED from gRPC itself)."""
        return None if self.deadline is None else max(self.deadline - time.monotonic(), 1e-3)

    def unary(self, method: str, request: Any) -> Any:
        """Call `method` (a MoeControlService method's name); an idempotent one is retried as
        the server's RetryInfo says (see the module's docstring)."""
        call = getattr(self.stub, method)
        retries = self.connection.max_retries if method in IDEMPOTENT_METHODS else 0
        for attempt in range(retries + 1):
            try:
                return call(request, timeout=self.remaining(), metadata=self.connection.metadata())
            except grpc.RpcError as error:
                delay = retry_delay(error)
                if delay is None or attempt == retries:
                    raise
                delay = min(delay, MAX_RETRY_DELAY_S)
                if self.deadline is not None and time.monotonic() + delay >= self.deadline:
                    raise
                time.sleep(delay)
        raise AssertionError("unreachable: the last attempt returns or raises")

    def stream(self, method: str, requests: Iterable[Any]) -> Iterator[Any]:
        """Call a streaming `method` (never retried: its request stream is consumed)."""
        responses: Iterator[Any] = getattr(self.stub, method)(
            iter(requests), timeout=self.remaining(), metadata=self.connection.metadata()
        )
        return responses
