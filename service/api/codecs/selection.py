"""SelectBackend's messages <-> domain: deployments, platforms, decisions, presets.

Requests become the deployment spec JSON object the oracle parses (the one input shape of the
library, the CLI and the API), so every validation rule lives once, in the oracle; a whole
request becomes the data plane's `SelectQuery`. Answers are built from the oracle's domain
objects (`select_answer`); `select_response_to_json` turns a response back into exactly the
JSON object `Decision.to_json()` gives, for the CLI client. The deployment and platform
conversions are shared by the other methods that name a deployment (ConvertWeights, RunMoE).
"""

from __future__ import annotations

from typing import Any

from google.protobuf import json_format, struct_pb2
from google.protobuf.message import DecodeError

from service.api.generated.moe_control.v1 import measured_pb2, platform_pb2, selection_pb2
from service.api.generated.moe_control.v1 import moe_control_service_pb2 as pb
from service.dataplane.selection import (
    MeasuredSelection,
    MeasureOptions,
    PlatformChoice,
    SelectAnswer,
    SelectQuery,
)
from service.oracle import (
    PLATFORM_PRESETS,
    Candidate,
    Change,
    ChangeHint,
    Decision,
    ErrorInfo,
    InvalidSpecError,
    PlatformProfile,
    SelectionError,
    Verdict,
    deployment_from_model_config,
    resolve_ruleset,
)
from service.oracle.json_text import parse_json_object

_DEVICE_TO_PB = {
    "cuda": platform_pb2.DEVICE_KIND_CUDA,
    "rocm": platform_pb2.DEVICE_KIND_ROCM,
    "xpu": platform_pb2.DEVICE_KIND_XPU,
    "cpu": platform_pb2.DEVICE_KIND_CPU,
}
_DEVICE_FROM_PB = {v: k for k, v in _DEVICE_TO_PB.items()}

_VERDICT_TO_PB = {
    Verdict.SELECTED: selection_pb2.VERDICT_SELECTED,
    Verdict.REJECTED: selection_pb2.VERDICT_REJECTED,
    Verdict.NOT_REACHED: selection_pb2.VERDICT_NOT_REACHED,
}
_VERDICT_FROM_PB = {v: k for k, v in _VERDICT_TO_PB.items()}

_MEASURED = measured_pb2.SELECTION_POLICY_MEASURED

_ACT_ORDER = {
    selection_pb2.ACT_ORDER_NONE: None,
    selection_pb2.ACT_ORDER_GROUP: "group",
    selection_pb2.ACT_ORDER_WEIGHT: "weight",
    selection_pb2.ACT_ORDER_DYNAMIC: "dynamic",
}

# ---------------------------------------------------------------------------------------
# JSON helpers


#: The largest integer a double holds exactly; a Struct number beyond it stays a float (so
#: 1e300 is refused where an integer belongs, not turned into a 301-digit integer).
_EXACT_IN_DOUBLE = 2**53


def _integral(value: Any) -> Any:
    """Struct numbers are doubles; JSON integers come back as ints (1.0 -> 1)."""
    if isinstance(value, float) and value.is_integer() and abs(value) <= _EXACT_IN_DOUBLE:
        return int(value)
    if isinstance(value, dict):
        return {k: _integral(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_integral(v) for v in value]
    return value


def struct_to_json(struct: struct_pb2.Struct) -> dict[str, Any]:
    """A `google.protobuf.Struct` as a JSON object, integral numbers as ints."""
    result: dict[str, Any] = _integral(json_format.MessageToDict(struct))
    return result


# ---------------------------------------------------------------------------------------
# Requests -> deployment spec JSON


def explicit_quantization_to_hf(explicit: selection_pb2.ExplicitQuantization) -> dict[str, Any]:
    """The Hugging Face `quantization_config` object equivalent to explicit fields."""
    method = explicit.method
    symmetric = explicit.symmetric if explicit.HasField("symmetric") else True
    if method == selection_pb2.QUANT_METHOD_GPTQ:
        config: dict[str, Any] = {
            "quant_method": "gptq",
            "bits": explicit.bits,
            "group_size": explicit.group_size,
            "sym": symmetric,
            "desc_act": explicit.desc_act,
        }
        if explicit.checkpoint_format:
            config["checkpoint_format"] = explicit.checkpoint_format
        return config
    if method == selection_pb2.QUANT_METHOD_AWQ:
        return {
            "quant_method": "awq",
            "bits": explicit.bits,
            "group_size": explicit.group_size,
            "zero_point": not symmetric,
            "version": explicit.version or "gemm",
        }
    if method == selection_pb2.QUANT_METHOD_COMPRESSED_TENSORS:
        group = explicit.group_size
        weights: dict[str, Any] = {
            "num_bits": explicit.bits,
            "type": "int",
            "symmetric": symmetric,
            "strategy": "channel" if group in (0, -1) else "group",
            "group_size": None if group in (0, -1) else group,
            "dynamic": False,
            "actorder": _ACT_ORDER.get(explicit.act_order),
        }
        return {
            "quant_method": "compressed-tensors",
            "format": "pack-quantized",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights}},
            "ignore": [],
        }
    raise InvalidSpecError.single(
        "spec.quantization_config.explicit.method",
        "must be one of QUANT_METHOD_GPTQ, QUANT_METHOD_AWQ, QUANT_METHOD_COMPRESSED_TENSORS",
    )


def quantization_config_to_json(config: selection_pb2.QuantizationConfig) -> dict[str, Any]:
    source = config.WhichOneof("source")
    if source == "hf_config":
        return struct_to_json(config.hf_config)
    if source == "hf_config_json":
        return parse_json_object(config.hf_config_json, "spec.quantization_config.hf_config_json")
    if source == "explicit":
        return explicit_quantization_to_hf(config.explicit)
    return {}


def _parallel_to_json(parallel: selection_pb2.ParallelConfig) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in ("tensor_parallel_size", "data_parallel_size"):
        if parallel.HasField(name):
            out[name] = getattr(parallel, name)
    for name in ("enable_expert_parallel", "enable_eplb"):
        if parallel.HasField(name):
            out[name] = getattr(parallel, name)
    if parallel.all2all_backend:
        out["all2all_backend"] = parallel.all2all_backend
    return out


def _routing_to_json(routing: selection_pb2.RoutingConfig) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in ("scoring_func", "router_logits_dtype"):
        if getattr(routing, name):
            out[name] = getattr(routing, name)
    for name in (
        "renormalize",
        "use_grouped_topk",
        "num_expert_group",
        "topk_group",
        "e_score_correction_bias",
        "routed_scaling_factor",
    ):
        if routing.HasField(name):
            out[name] = getattr(routing, name)
    return out


def _layer_to_json(layer: selection_pb2.MoeLayer) -> dict[str, Any]:
    out: dict[str, Any] = {}
    # Zero means "not given": the oracle then names the missing field.
    for name in ("num_experts", "top_k", "hidden_size", "intermediate_size"):
        if getattr(layer, name):
            out[name] = getattr(layer, name)
    for name in ("activation", "dtype", "name"):
        if getattr(layer, name):
            out[name] = getattr(layer, name)
    if layer.HasField("has_bias"):
        out["has_bias"] = layer.has_bias
    if layer.HasField("routing"):
        out["routing"] = _routing_to_json(layer.routing)
    return out


def spec_to_json(spec: selection_pb2.DeploymentSpec) -> dict[str, Any]:
    """A typed DeploymentSpec as the deployment spec JSON object (absent fields left out)."""
    out: dict[str, Any] = {}
    if spec.HasField("quantization_config"):
        out["hf_quantization_config"] = quantization_config_to_json(spec.quantization_config)
    if spec.quantization:
        out["quantization"] = spec.quantization
    if spec.HasField("layer"):
        out["layer"] = _layer_to_json(spec.layer)
    if spec.HasField("parallel"):
        out["parallel"] = _parallel_to_json(spec.parallel)
    if spec.moe_backend:
        out["moe_backend"] = spec.moe_backend
    if spec.HasField("lora"):
        out["lora"] = spec.lora
    return out


def model_config_to_json(model: selection_pb2.ModelConfig) -> dict[str, Any]:
    """A model's config.json plus vLLM flags as a deployment spec (without platform)."""
    source = model.WhichOneof("source")
    if source == "config_json":
        config = parse_json_object(model.config_json, "model_config.config_json")
    elif source == "config":
        config = struct_to_json(model.config)
    else:
        raise InvalidSpecError.single(
            "model_config", "required: config_json (the config.json text) or config"
        )
    spec = dict(deployment_from_model_config(config))
    if model.quantization:
        spec["quantization"] = model.quantization
    if model.moe_backend:
        spec["moe_backend"] = model.moe_backend
    if model.HasField("parallel"):
        spec["parallel"] = {**spec.get("parallel", {}), **_parallel_to_json(model.parallel)}
    if model.HasField("lora"):
        spec["lora"] = model.lora
    return spec


def deployment_to_json(
    message: pb.SelectBackendRequest | pb.ConvertWeightsHeader | pb.DiffRulesetsRequest,
) -> dict[str, Any]:
    """The deployment of a request (its `deployment` oneof) as a spec JSON object."""
    which = message.WhichOneof("deployment")
    if which == "spec":
        return spec_to_json(message.spec)
    if which == "spec_json":
        return parse_json_object(message.spec_json, "spec_json")
    if which == "model_config":
        return model_config_to_json(message.model_config)
    raise InvalidSpecError.single(
        "deployment", "required: one of spec, spec_json (a deployment spec) or model_config"
    )


# ---------------------------------------------------------------------------------------
# Platforms


#: Messages of recently seen profiles (presets and worker profiles are long-lived objects),
#: by identity; the profile is kept beside its message so the id cannot be reused.
_PLATFORM_MESSAGES: dict[int, tuple[PlatformProfile, platform_pb2.PlatformProfile]] = {}
_PLATFORM_MESSAGES_MAX = 256


def platform_to_pb(profile: PlatformProfile) -> platform_pb2.PlatformProfile:
    """The message of a profile (built once per profile object; treat it as read-only)."""
    cached = _PLATFORM_MESSAGES.get(id(profile))
    if cached is not None and cached[0] is profile:
        return cached[1]
    message = _build_platform(profile)
    if len(_PLATFORM_MESSAGES) >= _PLATFORM_MESSAGES_MAX:
        _PLATFORM_MESSAGES.clear()
    _PLATFORM_MESSAGES[id(profile)] = (profile, message)
    return message


def _build_platform(profile: PlatformProfile) -> platform_pb2.PlatformProfile:
    message = platform_pb2.PlatformProfile(
        device=_DEVICE_TO_PB.get(profile.device, platform_pb2.DEVICE_KIND_UNSPECIFIED),
        arch=profile.arch or "",
        amx=profile.amx,
        x86=profile.x86,
        packages=platform_pb2.PackageSet(names=sorted(profile.packages)),
        env=dict(profile.env),
        name=profile.name or "",
        preset=profile.preset or "",
    )
    if profile.capability is not None:
        major, minor = profile.capability
        message.capability.major = major
        message.capability.minor = minor
    return message


def platform_to_json(message: platform_pb2.PlatformProfile) -> dict[str, Any]:
    """A PlatformProfile message in the JSON form `PlatformProfile.from_json` reads."""
    out: dict[str, Any] = {"device": _DEVICE_FROM_PB.get(message.device)}
    if message.HasField("capability"):
        out["capability"] = f"{message.capability.major}.{message.capability.minor}"
    if message.arch:
        out["arch"] = message.arch
    if message.amx:
        out["amx"] = True
    if message.HasField("x86"):
        out["x86"] = message.x86
    if message.HasField("packages"):
        out["packages"] = list(message.packages.names)
    if message.env:
        out["env"] = dict(message.env)
    if message.name:
        out["name"] = message.name
    if message.preset:
        out["preset"] = message.preset
    return out


def platform_choice(selector: selection_pb2.PlatformSelector) -> PlatformChoice | None:
    """The platform a request's PlatformSelector names; None when unset."""
    which = selector.WhichOneof("source")
    if which == "preset":
        return PlatformChoice(preset=selector.preset)
    if which == "profile":
        return PlatformChoice(profile=platform_to_json(selector.profile))
    if which == "worker_index":
        return PlatformChoice(worker_index=selector.worker_index)
    return None


def presets_response() -> pb.ListPlatformPresetsResponse:
    """Every platform preset, by name."""
    return pb.ListPlatformPresetsResponse(
        presets=[
            platform_pb2.PlatformPreset(name=name, profile=platform_to_pb(profile))
            for name, profile in sorted(PLATFORM_PRESETS.items())
        ]
    )


# ---------------------------------------------------------------------------------------
# Queries and answers


def select_request(data: bytes) -> pb.SelectBackendRequest:
    """A SelectBackendRequest from its wire form (InvalidSpecError when it is not one)."""
    try:
        return pb.SelectBackendRequest.FromString(data)
    except DecodeError:
        raise InvalidSpecError.single(
            "", "the request is not a moe_control.v1.SelectBackendRequest message"
        ) from None


def select_query(request: pb.SelectBackendRequest) -> SelectQuery:
    """The data plane's query for a request (its deployment converted now, so a bad one
    fails before anything else is judged)."""
    measure = None
    if request.policy == _MEASURED:
        measure = MeasureOptions(
            token_counts=tuple(request.token_counts),
            worker_index=(
                request.measure_worker_index if request.HasField("measure_worker_index") else None
            ),
            refresh=request.refresh,
        )
    # positional: a query is built on every answer that is not a kept one
    return SelectQuery(
        deployment_to_json(request),
        platform_choice(request.platform),
        resolve_ruleset(request.ruleset) if request.ruleset else "",
        measure,
        request.what_would_change,
    )


def select_answer(answer: SelectAnswer) -> pb.SelectBackendResponse:
    """The response for an answer: its decision, or (measured answers only) the static
    failure, with the measured part when there is one."""
    if answer.decision is not None:
        assert answer.platform is not None
        response = select_response(answer.decision, answer.platform, answer.server_platform)
    else:
        assert answer.failure is not None
        response = failed_static(answer.ruleset, answer.failure)
    if answer.measured is not None:
        measured_to_pb(response.measured, answer.measured)
    return response


def failed_static(ruleset: str, exc: SelectionError) -> pb.SelectBackendResponse:
    """The static part of a MEASURED answer where vLLM itself would fail the deployment: no
    backend, every candidate with its reason, and the failure as a hazard. The timings
    still say what this worker runs (a static request gets FAILED_PRECONDITION instead)."""
    response = pb.SelectBackendResponse(
        ruleset=ruleset,
        quantization=exc.quantization or "",
        moe_method=exc.moe_method or "",
        candidates=[candidate_to_pb(c) for c in exc.candidates],
        hazards=[
            selection_pb2.Hazard(
                code="VLLM_FAILS", message=f"vLLM would fail ({exc.error.stage}): {exc}"
            )
        ],
    )
    if isinstance(exc.platform, PlatformProfile):
        response.platform.CopyFrom(platform_to_pb(exc.platform))
    if exc.what_would_change is not None:
        hints_to_pb(response.what_would_change, exc.what_would_change)
    return response


def measured_to_pb(message: measured_pb2.MeasuredSelection, measured: MeasuredSelection) -> None:
    """Fill a response's `measured` part (fields the domain leaves unset stay unset)."""
    message.worker_index = measured.worker_index
    message.device_name = measured.device_name
    message.versions.update(measured.versions)
    for bucket in measured.buckets:
        out = message.buckets.add(tokens=bucket.tokens, static_backend=bucket.static_backend)
        for timing in bucket.timings:
            item = out.timings.add(backend=timing.backend, error=timing.error)
            if timing.seconds is not None:
                item.device_seconds = timing.seconds
        if bucket.static_seconds is not None:
            out.static_seconds = bucket.static_seconds
        if bucket.fastest is not None:
            out.fastest_seconds, out.fastest_backend = bucket.fastest
        if bucket.speedup is not None:
            out.speedup = bucket.speedup
    if measured.measured_time is not None:
        message.measured_time.FromNanoseconds(int(measured.measured_time * 1e9))
    message.from_cache = measured.from_cache
    message.measure_seconds = measured.measure_seconds


# ---------------------------------------------------------------------------------------
# Decisions


def candidate_to_pb(candidate: Candidate) -> selection_pb2.BackendCandidate:
    return selection_pb2.BackendCandidate(
        backend=candidate.backend,
        verdict=_VERDICT_TO_PB[candidate.verdict],
        reason_code=candidate.reason_code,
        reason=candidate.reason,
        explanation=candidate.explanation,
    )


def candidate_from_pb(message: selection_pb2.BackendCandidate) -> Candidate:
    return Candidate(
        backend=message.backend,
        verdict=_VERDICT_FROM_PB[message.verdict],
        reason_code=message.reason_code,
        reason=message.reason,
        explanation=message.explanation,
    )


def hints_to_pb(message: selection_pb2.WhatWouldChange, hints: tuple[ChangeHint, ...]) -> None:
    """Fill a WhatWouldChange (an empty one still says the search ran)."""
    message.SetInParent()
    for hint in hints:
        message.hints.add(
            backend=hint.backend,
            outcome=hint.outcome,
            changes=[
                selection_pb2.DecisionChange(kind=c.kind, field=c.field, value=c.value, text=c.text)
                for c in hint.changes
            ],
        )


def hints_from_pb(message: selection_pb2.WhatWouldChange) -> tuple[ChangeHint, ...]:
    return tuple(
        ChangeHint(
            hint.backend,
            hint.outcome,
            tuple(Change(c.kind, c.field, c.value, c.text) for c in hint.changes),
        )
        for hint in message.hints
    )


def _hints_json(holder: Any) -> list[dict[str, Any]] | None:
    if not holder.HasField("what_would_change"):
        return None
    return [h.to_json() for h in hints_from_pb(holder.what_would_change)]


def profile_json(message: platform_pb2.PlatformProfile) -> dict[str, Any]:
    """A PlatformProfile message as exactly the JSON `PlatformProfile.to_json()` gives."""
    return PlatformProfile.from_json(platform_to_json(message)).to_json()


def select_response(
    decision: Decision,
    platform: PlatformProfile,
    server_platform: PlatformProfile | None,
) -> pb.SelectBackendResponse:
    response = pb.SelectBackendResponse(
        ruleset=decision.ruleset,
        quantization=decision.quantization,
        moe_method=decision.moe_method,
        candidates=[candidate_to_pb(c) for c in decision.candidates],
        hazards=[selection_pb2.Hazard(code=h.code, message=h.message) for h in decision.hazards],
        platform=platform_to_pb(platform),
        explanation=decision.explanation,
    )
    if decision.what_would_change is not None:
        hints_to_pb(response.what_would_change, decision.what_would_change)
    if decision.backend is not None:
        response.backend = decision.backend
    if decision.experts_class is not None:
        response.experts_class = decision.experts_class
    key = decision.weight_key
    if key is not None:
        response.weight_key.dtype = key.dtype
        response.weight_key.scale_dtype = key.scale_dtype
        response.weight_key.group_shape.extend(key.group_shape)
        response.weight_key.symmetric = key.symmetric
    for name in ("may_have_zp", "may_have_bias", "allow_tile_padding"):
        value = getattr(decision, name)
        if value is not None:
            setattr(response, name, value)
    if server_platform is not None:
        response.server_platform.CopyFrom(platform_to_pb(server_platform))
    return response


def _optional(message: Any, name: str) -> Any:
    return getattr(message, name) if message.HasField(name) else None


def candidate_to_json(message: selection_pb2.BackendCandidate) -> dict[str, str]:
    return candidate_from_pb(message).to_json()


def select_response_to_json(response: pb.SelectBackendResponse) -> dict[str, Any]:
    """The response as exactly the JSON object `Decision.to_json()` gives."""
    key = response.weight_key if response.HasField("weight_key") else None
    return {
        "ruleset": response.ruleset,
        "platform": profile_json(response.platform) if response.HasField("platform") else None,
        "quantization": response.quantization,
        "moe_method": response.moe_method,
        "backend": _optional(response, "backend"),
        "experts_class": _optional(response, "experts_class"),
        "weight_key": None
        if key is None
        else {
            "dtype": key.dtype,
            "scale_dtype": key.scale_dtype,
            "group_shape": list(key.group_shape),
            "symmetric": key.symmetric,
        },
        "may_have_zp": _optional(response, "may_have_zp"),
        "may_have_bias": _optional(response, "may_have_bias"),
        "allow_tile_padding": _optional(response, "allow_tile_padding"),
        "candidates": [candidate_to_json(c) for c in response.candidates],
        "hazards": [{"code": h.code, "message": h.message} for h in response.hazards],
        "explanation": response.explanation,
        "what_would_change": _hints_json(response),
    }


def selection_failure_to_pb(error: SelectionError) -> selection_pb2.SelectionFailure:
    failure = selection_pb2.SelectionFailure(
        stage=error.error.stage,
        type=error.error.type,
        message=error.error.message,
        candidates=[candidate_to_pb(c) for c in error.candidates],
        ruleset=error.ruleset or "",
    )
    if isinstance(error.platform, PlatformProfile):
        failure.platform.CopyFrom(platform_to_pb(error.platform))
    if error.what_would_change is not None:
        hints_to_pb(failure.what_would_change, error.what_would_change)
    if error.quantization is not None:
        failure.quantization = error.quantization
    if error.moe_method is not None:
        failure.moe_method = error.moe_method
    return failure


def selection_error_from_pb(failure: selection_pb2.SelectionFailure) -> SelectionError:
    """Rebuild the oracle's SelectionError on the client side of a FAILED_PRECONDITION."""
    return SelectionError(
        ErrorInfo(stage=failure.stage, type=failure.type, message=failure.message),
        candidates=tuple(candidate_from_pb(c) for c in failure.candidates),
        quantization=_optional(failure, "quantization"),
        moe_method=_optional(failure, "moe_method"),
        ruleset=failure.ruleset or None,
        platform=(
            PlatformProfile.from_json(platform_to_json(failure.platform))
            if failure.HasField("platform")
            else None
        ),
        what_would_change=(
            hints_from_pb(failure.what_would_change)
            if failure.HasField("what_would_change")
            else None
        ),
    )
