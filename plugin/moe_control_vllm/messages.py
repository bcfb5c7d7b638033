"""The wire form of a report (observed.proto's ReportDecisionsRequest), built on the
sending thread: protobuf is never imported on vLLM's path."""

from __future__ import annotations

from collections.abc import Sequence

from moe_control_vllm.generated.moe_control.v1 import observed_pb2
from moe_control_vllm.record import Decision, Process

_VERDICTS = {
    "selected": observed_pb2.OBSERVED_VERDICT_SELECTED,
    "rejected": observed_pb2.OBSERVED_VERDICT_REJECTED,
    "not_reached": observed_pb2.OBSERVED_VERDICT_NOT_REACHED,
}


def decision_pb(decision: Decision) -> observed_pb2.ObservedDecision:
    key = decision.weight_key
    message = observed_pb2.ObservedDecision(
        layer_name=decision.layer_name,
        layer_count=decision.layer_count,
        moe_method=decision.moe_method,
        integration=decision.integration,
        deployment_json=decision.deployment_json,
        weight_key=observed_pb2.ObservedWeightKey(
            dtype=key.dtype,
            scale_dtype=key.scale_dtype,
            group_shape=list(key.group_shape),
            symmetric=key.symmetric,
        ),
        may_have_zp=decision.may_have_zp,
        may_have_bias=decision.may_have_bias,
        allow_tile_padding=decision.allow_tile_padding,
        backend=decision.backend,
        experts_class=decision.experts_class,
        candidates=[
            observed_pb2.ObservedCandidate(
                backend=c.backend, verdict=_VERDICTS[c.verdict], reason=c.reason
            )
            for c in decision.candidates
        ],
    )
    if decision.error is not None:
        message.error.type, message.error.message = decision.error
    return message


def process_pb(process: Process) -> observed_pb2.ReportingProcess:
    return observed_pb2.ReportingProcess(
        host=process.host,
        pod=process.pod,
        namespace=process.namespace,
        pid=process.pid,
        vllm_version=process.vllm_version,
        plugin_version=process.plugin_version,
        model=process.model,
    )


def report_request(
    process: Process, decisions: Sequence[Decision]
) -> observed_pb2.ReportDecisionsRequest:
    return observed_pb2.ReportDecisionsRequest(
        process=process_pb(process), decisions=[decision_pb(d) for d in decisions]
    )
