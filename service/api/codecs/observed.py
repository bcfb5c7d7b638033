"""ReportDecisions and ListObservedDecisions on the wire (observed.proto).

A report comes from a vLLM process, so it is bounded before anything is kept: at most
`MAX_BATCH` decisions a call, `MAX_REPORT_BYTES` a message, `MAX_DEPLOYMENT_BYTES` of
deployment JSON, `MAX_TEXT` characters a string and `MAX_CANDIDATES` candidates a decision.
Anything over a bound is INVALID_ARGUMENT naming the field (the plugin never sends such a
report, so a caller that does is not the plugin).
"""

from __future__ import annotations

from google.protobuf import timestamp_pb2

from service.api.generated.moe_control.v1 import observed_pb2
from service.dataplane.observed import (
    ObservedDecision,
    ObservedEntry,
    ReportingProcess,
)
from service.oracle import FieldViolation, InvalidSpecError
from service.oracle.decision import WeightKey
from service.oracle.observed import CandidateOutcome, Outcome, error_text

#: Decisions one ReportDecisions call may carry.
MAX_BATCH = 64
#: Bytes of one ReportDecisions message.
MAX_REPORT_BYTES = 1024 * 1024
#: Bytes of one decision's deployment JSON.
MAX_DEPLOYMENT_BYTES = 16 * 1024
#: Characters of any other string (names, versions, reasons, messages).
MAX_TEXT = 2048
#: Candidates of one decision (vLLM's priority lists are a handful long).
MAX_CANDIDATES = 32

_VERDICTS = {
    observed_pb2.OBSERVED_VERDICT_SELECTED: "selected",
    observed_pb2.OBSERVED_VERDICT_REJECTED: "rejected",
    observed_pb2.OBSERVED_VERDICT_NOT_REACHED: "not_reached",
}
_VERDICT_PB = {name: value for value, name in _VERDICTS.items()}


class _Checker:
    """Collects every bound a report breaks, so a caller fixes it in one round trip."""

    def __init__(self) -> None:
        self.violations: list[FieldViolation] = []

    def text(self, field: str, value: str, limit: int = MAX_TEXT) -> str:
        if len(value) > limit:
            self.violations.append(FieldViolation(field, f"longer than {limit} characters"))
        return value


def report_request(
    request: observed_pb2.ReportDecisionsRequest,
) -> tuple[ReportingProcess, list[ObservedDecision]]:
    """The reporting process and its decisions, every bound checked."""
    check = _Checker()
    if request.ByteSize() > MAX_REPORT_BYTES:
        raise InvalidSpecError.single("", f"a report must be at most {MAX_REPORT_BYTES} bytes")
    if len(request.decisions) > MAX_BATCH:
        raise InvalidSpecError.single(
            "decisions", f"at most {MAX_BATCH} decisions a call, got {len(request.decisions)}"
        )
    p = request.process
    process = ReportingProcess(
        host=check.text("process.host", p.host),
        pod=check.text("process.pod", p.pod),
        namespace=check.text("process.namespace", p.namespace),
        pid=p.pid,
        vllm_version=check.text("process.vllm_version", p.vllm_version),
        plugin_version=check.text("process.plugin_version", p.plugin_version),
        model=check.text("process.model", p.model),
    )
    decisions = [_decision(check, f"decisions[{i}]", d) for i, d in enumerate(request.decisions)]
    if check.violations:
        raise InvalidSpecError(check.violations)
    return process, decisions


def _decision(check: _Checker, at: str, d: observed_pb2.ObservedDecision) -> ObservedDecision:
    if len(d.candidates) > MAX_CANDIDATES:
        check.violations.append(
            FieldViolation(f"{at}.candidates", f"at most {MAX_CANDIDATES} candidates")
        )
    if not d.deployment_json:
        check.violations.append(FieldViolation(f"{at}.deployment_json", "required"))
    candidates = tuple(
        CandidateOutcome(
            check.text(f"{at}.candidates[{j}].backend", c.backend),
            _VERDICTS.get(c.verdict, "unspecified"),
            check.text(f"{at}.candidates[{j}].reason", c.reason),
        )
        for j, c in enumerate(d.candidates[:MAX_CANDIDATES])
    )
    key = d.weight_key if d.HasField("weight_key") else None
    if key is not None and len(key.group_shape) != 2:
        check.violations.append(FieldViolation(f"{at}.weight_key.group_shape", "two entries"))
        key = None
    error = None
    if d.HasField("error"):
        error = error_text(
            check.text(f"{at}.error.type", d.error.type),
            check.text(f"{at}.error.message", d.error.message),
        )
    outcome = Outcome(
        integration=check.text(f"{at}.integration", d.integration) or None,
        moe_method=check.text(f"{at}.moe_method", d.moe_method) or None,
        backend=check.text(f"{at}.backend", d.backend) or None,
        experts_class=check.text(f"{at}.experts_class", d.experts_class) or None,
        error=error,
        weight_key=None
        if key is None
        else WeightKey(
            check.text(f"{at}.weight_key.dtype", key.dtype),
            check.text(f"{at}.weight_key.scale_dtype", key.scale_dtype),
            (int(key.group_shape[0]), int(key.group_shape[1])),
            key.symmetric,
        ),
        may_have_zp=d.may_have_zp,
        may_have_bias=d.may_have_bias,
        allow_tile_padding=d.allow_tile_padding,
        candidates=candidates,
    )
    return ObservedDecision(
        layer_name=check.text(f"{at}.layer_name", d.layer_name),
        layer_count=d.layer_count,
        deployment_json=check.text(
            f"{at}.deployment_json", d.deployment_json, MAX_DEPLOYMENT_BYTES
        ),
        outcome=outcome,
    )


# ---------------------------------------------------------------------------------------
# Back out


def _weight_key_pb(key: WeightKey | None) -> observed_pb2.ObservedWeightKey | None:
    if key is None:
        return None
    return observed_pb2.ObservedWeightKey(
        dtype=key.dtype,
        scale_dtype=key.scale_dtype,
        group_shape=list(key.group_shape),
        symmetric=key.symmetric,
    )


def _candidates_pb(outcome: Outcome) -> list[observed_pb2.ObservedCandidate]:
    return [
        observed_pb2.ObservedCandidate(
            backend=c.backend,
            verdict=_VERDICT_PB.get(c.verdict, observed_pb2.OBSERVED_VERDICT_UNSPECIFIED),
            reason=c.reason,
        )
        for c in outcome.candidates
    ]


def _error_pb(text: str | None) -> observed_pb2.ObservedError | None:
    if text is None:
        return None
    error_type, _, message = text.partition(": ")
    return observed_pb2.ObservedError(type=error_type, message=message)


def decision_to_pb(decision: ObservedDecision) -> observed_pb2.ObservedDecision:
    o = decision.outcome
    return observed_pb2.ObservedDecision(
        layer_name=decision.layer_name,
        layer_count=decision.layer_count,
        moe_method=o.moe_method or "",
        integration=o.integration or "",
        deployment_json=decision.deployment_json,
        weight_key=_weight_key_pb(o.weight_key),
        may_have_zp=bool(o.may_have_zp),
        may_have_bias=bool(o.may_have_bias),
        allow_tile_padding=bool(o.allow_tile_padding),
        backend=o.backend or "",
        experts_class=o.experts_class or "",
        error=_error_pb(o.error),
        candidates=_candidates_pb(o),
    )


def predicted_to_pb(o: Outcome) -> observed_pb2.PredictedDecision:
    message = observed_pb2.PredictedDecision(
        moe_method=o.moe_method or "",
        integration=o.integration or "",
        backend=o.backend or "",
        experts_class=o.experts_class or "",
        error=_error_pb(o.error),
        weight_key=_weight_key_pb(o.weight_key),
        candidates=_candidates_pb(o),
    )
    for name in ("may_have_zp", "may_have_bias", "allow_tile_padding"):
        value = getattr(o, name)
        if value is not None:
            setattr(message, name, value)
    return message


def _timestamp(seconds: float) -> timestamp_pb2.Timestamp:
    stamp = timestamp_pb2.Timestamp()
    stamp.FromNanoseconds(int(seconds * 1e9))
    return stamp


def entry_to_pb(entry: ObservedEntry) -> observed_pb2.ObservedDeployment:
    message = observed_pb2.ObservedDeployment(
        key=entry.key,
        count=entry.count,
        vllm_version=entry.vllm_version,
        ruleset=entry.ruleset,
        note=entry.note,
        release_not_modelled=not entry.release_modelled,
        observed=decision_to_pb(entry.observed),
        processes=[
            observed_pb2.ReportingProcess(
                host=p.host,
                pod=p.pod,
                namespace=p.namespace,
                pid=p.pid,
                vllm_version=p.vllm_version,
                plugin_version=p.plugin_version,
                model=p.model,
            )
            for p in entry.processes
        ],
        first_seen=_timestamp(entry.first_seen),
        last_seen=_timestamp(entry.last_seen),
    )
    if entry.predicted is not None:
        message.predicted.CopyFrom(predicted_to_pb(entry.predicted))
    if entry.difference is not None:
        message.first_difference = entry.difference.field
        message.observed_value = entry.difference.observed
        message.predicted_value = entry.difference.predicted
    return message


def listing_response(
    entries: list[ObservedEntry], evicted: int
) -> observed_pb2.ListObservedDecisionsResponse:
    return observed_pb2.ListObservedDecisionsResponse(
        deployments=[entry_to_pb(e) for e in entries], evicted=evicted
    )
