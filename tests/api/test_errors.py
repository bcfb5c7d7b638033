"""The one table from domain exceptions to gRPC statuses with details."""

from __future__ import annotations

from typing import Any

import pytest
from google.rpc import code_pb2, error_details_pb2

from service.api.errors import INTERNAL_MESSAGE, status_for
from service.api.generated.moe_control.v1 import selection_pb2
from service.dataplane.errors import BudgetExceededError
from service.oracle import (
    Candidate,
    ErrorInfo,
    FieldViolation,
    InvalidSpecError,
    SelectionError,
    UnknownRulesetError,
    Verdict,
)
from service.pool.errors import LayerNotFoundError, WorkerNotFoundError, WorkerUnavailableError


def detail(status: Any, kind: type) -> Any:
    for packed in status.details:
        message = kind()
        if packed.Unpack(message):
            return message
    raise AssertionError(f"no {kind.__name__}")


def test_invalid_spec_is_invalid_argument_with_bad_request() -> None:
    exc = InvalidSpecError([FieldViolation("layer.top_k", "required"), FieldViolation("x", "y")])
    status = status_for(exc)
    assert status.code == code_pb2.INVALID_ARGUMENT
    violations = detail(status, error_details_pb2.BadRequest).field_violations
    assert [(v.field, v.description) for v in violations] == [
        ("layer.top_k", "required"),
        ("x", "y"),
    ]
    assert status_for(UnknownRulesetError([FieldViolation("ruleset", "?")])).code == (
        code_pb2.INVALID_ARGUMENT
    )


def test_selection_error_is_failed_precondition_with_every_backend() -> None:
    candidates = (
        Candidate("MARLIN", Verdict.REJECTED, "DEVICE", "kernel does not support current device"),
        Candidate("TRITON", Verdict.NOT_REACHED, "", ""),
    )
    exc = SelectionError(
        ErrorInfo("backend", "NotImplementedError", "No WNA16 MoE backend supports it."),
        candidates=candidates,
        quantization="gptq_marlin",
        moe_method="GPTQMarlinMoEMethod",
    )
    status = status_for(exc)
    assert status.code == code_pb2.FAILED_PRECONDITION
    assert "No WNA16 MoE backend supports it." in status.message
    violations = detail(status, error_details_pb2.PreconditionFailure).violations
    assert [(v.type, v.subject, v.description) for v in violations] == [
        ("MARLIN", "DEVICE", "kernel does not support current device"),
        ("TRITON", "", ""),
    ]
    info = detail(status, error_details_pb2.ErrorInfo)
    assert info.reason == "BACKEND_SELECTION_FAILED"
    assert dict(info.metadata) == {"stage": "backend", "vllm_exception": "NotImplementedError"}
    failure = detail(status, selection_pb2.SelectionFailure)
    assert failure.moe_method == "GPTQMarlinMoEMethod"
    assert len(failure.candidates) == 2


@pytest.mark.parametrize(
    ("exc", "code"),
    [
        (WorkerUnavailableError("restarting"), code_pb2.UNAVAILABLE),
        (WorkerNotFoundError(3, 1), code_pb2.NOT_FOUND),
        (LayerNotFoundError("l-1"), code_pb2.NOT_FOUND),
        (NotImplementedError("RunMoE lands later"), code_pb2.UNIMPLEMENTED),
        (BudgetExceededError("the diff", 2.0, "--cpu-budget-s"), code_pb2.DEADLINE_EXCEEDED),
    ],
)
def test_other_domain_errors(exc: Exception, code: int) -> None:
    status = status_for(exc)
    assert status.code == code
    assert status.message == str(exc)


def test_anything_else_is_internal_without_leaking_its_text() -> None:
    status = status_for(KeyError("/secret/path"))
    assert status.code == code_pb2.INTERNAL
    assert status.message == INTERNAL_MESSAGE
    assert not status.details


def test_a_configured_size_limit_is_resource_exhausted_naming_field_and_limit() -> None:
    from service.dataplane.errors import RunResourceError
    from service.formats.errors import ConvertInputError, StreamError
    from service.formats.io.streaming import StreamBudget, TensorSpec

    budget = StreamBudget(10)
    with pytest.raises(StreamError) as over:
        budget.reserve(TensorSpec.of("w", "uint8", (11,)))
    inline = RunResourceError("inline_layer.tensors", "too big", "run_max_inline_bytes")
    for exc, field, limit, reason in (
        (over.value, "tensors[w].byte_size", "convert_max_layer_bytes", "CONVERT_LIMIT"),
        (inline, "inline_layer.tensors", "run_max_inline_bytes", "RUN_MOE_LIMIT"),
    ):
        status = status_for(exc)
        assert status.code == code_pb2.RESOURCE_EXHAUSTED
        assert detail(status, error_details_pb2.BadRequest).field_violations[0].field == field
        info = detail(status, error_details_pb2.ErrorInfo)
        assert (info.reason, dict(info.metadata)) == (reason, {"field": field, "limit": limit})
        assert detail(status, error_details_pb2.QuotaFailure).violations[0].subject == field
    # Inconsistent input stays INVALID_ARGUMENT.
    assert status_for(ConvertInputError("tensors[w].data", "short")).code == (
        code_pb2.INVALID_ARGUMENT
    )


def test_a_full_method_limit_is_resource_exhausted_with_quota_failure() -> None:
    from service.api.errors import ConcurrencyLimitError

    method = "/moe_control.v1.MoeControlService/RunMoE"
    status = status_for(ConcurrencyLimitError(method, "max_concurrent_run", 4))
    assert status.code == code_pb2.RESOURCE_EXHAUSTED
    assert detail(status, error_details_pb2.QuotaFailure).violations[0].subject == method
    info = detail(status, error_details_pb2.ErrorInfo)
    assert dict(info.metadata) == {"method": method, "limit": "max_concurrent_run", "value": "4"}
    assert detail(status, error_details_pb2.RetryInfo).retry_delay.nanos == 100_000_000
