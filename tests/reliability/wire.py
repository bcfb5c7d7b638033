"""Raw-bytes gRPC calls and answer checks shared by the reliability tests.

Why raw bytes: a hostile client does not use our stubs, so requests go out through a
generic channel with identity serializers; whatever protobuf the server can or cannot make
of them is the server's problem, and the answer must still be a well-formed status.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from service.api.names import SERVICE_NAME

SERVICE = SERVICE_NAME
UNARY = (
    "SelectBackend",
    "RunMoE",
    "GetPlatform",
    "ListPlatformPresets",
    "ListRulesets",
    "DiffRulesets",
    "ListWorkers",
    "ListLayers",
    "UnloadLayer",
)
#: The statuses a hostile request may get (OK too: random bytes can be a valid message).
ALLOWED = frozenset(
    {
        grpc.StatusCode.OK,
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.PERMISSION_DENIED,
        grpc.StatusCode.NOT_FOUND,
        grpc.StatusCode.UNIMPLEMENTED,  # RunMoE until it lands
    }
)
#: Every call has a deadline: a hung call fails the test as DEADLINE_EXCEEDED.
DEADLINE_S = 20.0


def _identity(data: bytes) -> bytes:
    return data


@dataclass
class Answer:
    code: grpc.StatusCode
    details: str = ""
    fields: list[str] = field(default_factory=list)
    has_bad_request: bool = False


def _answer(error: grpc.RpcError) -> Answer:
    code = error.code()  # type: ignore[attr-defined]
    answer = Answer(code, error.details() or "")  # type: ignore[attr-defined]
    status = rpc_status.from_call(error)  # type: ignore[arg-type]
    if status is not None:
        for detail in status.details:
            bad = error_details_pb2.BadRequest()
            if detail.Unpack(bad):
                answer.has_bad_request = True
                answer.fields.extend(v.field for v in bad.field_violations)
    return answer


TALLY: Counter[str] = Counter()


Metadata = tuple[tuple[str, str], ...]


def unary(channel: grpc.Channel, method: str, data: bytes) -> Answer:
    return unary_with(channel, method, data, ())


def unary_with(channel: grpc.Channel, method: str, data: bytes, metadata: Metadata) -> Answer:
    call = channel.unary_unary(
        f"/{SERVICE}/{method}", request_serializer=_identity, response_deserializer=_identity
    )
    try:
        call(data, metadata=metadata, timeout=DEADLINE_S)
        answer = Answer(grpc.StatusCode.OK)
    except grpc.RpcError as error:
        answer = _answer(error)
    TALLY[f"{method} {answer.code.name}"] += 1
    return answer


def stream(channel: grpc.Channel, messages: Iterable[bytes]) -> Answer:
    return stream_with(channel, messages, ())


def stream_with(channel: grpc.Channel, messages: Iterable[bytes], metadata: Metadata) -> Answer:
    call = channel.stream_stream(
        f"/{SERVICE}/ConvertWeights",
        request_serializer=_identity,
        response_deserializer=_identity,
    )
    try:
        for _ in call(iter(list(messages)), metadata=metadata, timeout=DEADLINE_S):
            pass
        answer = Answer(grpc.StatusCode.OK)
    except grpc.RpcError as error:
        answer = _answer(error)
    TALLY[f"ConvertWeights {answer.code.name}"] += 1
    return answer


def check(answer: Answer, *, named: bool = True) -> None:
    """A well-formed answer: an allowed code; INVALID_ARGUMENT carries a BadRequest whose
    violations name the field (`named=False`: a whole-message decode failure, field "")."""
    assert answer.code in ALLOWED, f"{answer.code.name}: {answer.details}"
    if answer.code is grpc.StatusCode.INVALID_ARGUMENT:
        assert answer.has_bad_request, f"INVALID_ARGUMENT without BadRequest: {answer.details}"
        if named:
            assert any(answer.fields), f"no field named: {answer.details}"


def examples(default: int) -> int:
    """Examples per property: `default` in `make test`; MOE_CONTROL_FUZZ_EXAMPLES (the
    nightly size, e.g. 10000) scales every property to that many."""
    return int(os.environ.get("MOE_CONTROL_FUZZ_EXAMPLES", default))


def tree_rss_bytes(pid: int) -> int:
    """Resident memory of a process and all its descendants (the server and its workers)."""
    total, todo = 0, [pid]
    while todo:
        current = todo.pop()
        try:
            status = Path(f"/proc/{current}/status").read_text()
        except OSError:
            continue
        for line in status.splitlines():
            if line.startswith("VmRSS:"):
                total += int(line.split()[1]) * 1024
        for task in Path(f"/proc/{current}/task").glob("*/children"):
            try:
                todo.extend(int(child) for child in task.read_text().split())
            except OSError:
                continue
    return total
