"""The deployment spec: the one input shape shared by the library, the CLI and the gRPC API.

A spec says what vLLM would be asked to serve (the checkpoint's `quantization_config`, the MoE
layer's shape, the parallel layout, vLLM's `--quantization` and `--moe-backend` flags) and
where (a platform profile or a preset name). Everything except the quantization config and
the layer shape has a default. Parsing collects every bad field at once, so a caller fixes
a request in one round trip.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from service.oracle.errors import FieldViolation, InvalidSpecError
from service.oracle.platform import PlatformProfile, preset
from service.oracle.releases import resolve_ruleset

#: vLLM's `MoEActivation` values; the `_no_mul` ones are the non-gated (no act-and-mul) forms.
ACTIVATIONS = (
    "silu",
    "gelu",
    "gelu_tanh",
    "relu2",
    "swigluoai",
    "situ",
    "swigluoai_uninterleave",
    "swiglustep",
    "silu_no_mul",
    "gelu_no_mul",
    "gelu_tanh_no_mul",
    "relu2_no_mul",
)
DTYPES = ("bfloat16", "float16")
SCORING_FUNCS = ("softmax", "sigmoid", "sqrtsoftplus")
ROUTER_LOGITS_DTYPES = ("float32", "bfloat16", "float16")
#: vLLM's `--all2all-backend` values, every release's (what changes the MoE activation format
#: and kernels); a release that lacks one refuses it (`Ruleset.all2all_backends`).
ALL2ALL_BACKENDS = (
    "allgather_reducescatter",
    "naive",
    "pplx",
    "deepep_high_throughput",
    "deepep_low_latency",
    "deepep_v2",
    "mori_high_throughput",
    "mori_low_latency",
    "nixl_ep",
    "flashinfer_all2allv",
    "flashinfer_nvlink_two_sided",
    "flashinfer_nvlink_one_sided",
    "passthrough",
    "moonep",
    "mori",
)
#: vLLM's `--quantization` values that reach a WNA16 MoE method.
USER_QUANTIZATIONS = (
    "gptq",
    "gptq_marlin",
    "auto_gptq",
    "marlin",
    "awq",
    "awq_marlin",
    "auto_awq",
    "moe_wna16",
    "compressed-tensors",
    "quark",
)
DEFAULT_LAYER_NAME = "model.layers.0.mlp.experts"
#: The largest count or size a spec field may hold: vLLM's MoE kernels take expert ids as
#: int32 and their sizes as 32-bit integers, so no layer vLLM can build is larger.
MAX_SIZE = 2**31 - 1


@dataclass(frozen=True, slots=True)
class RoutingSpec:
    scoring_func: str = "softmax"
    renormalize: bool = True
    use_grouped_topk: bool = False
    num_expert_group: int | None = None
    topk_group: int | None = None
    e_score_correction_bias: bool = False
    routed_scaling_factor: float = 1.0
    router_logits_dtype: str | None = None


@dataclass(frozen=True, slots=True)
class LayerSpec:
    num_experts: int
    top_k: int
    hidden_size: int
    intermediate_size: int
    activation: str = "silu"
    has_bias: bool = False
    dtype: str = "bfloat16"
    name: str = DEFAULT_LAYER_NAME
    routing: RoutingSpec = field(default_factory=RoutingSpec)

    @property
    def is_gated(self) -> bool:
        return not self.activation.endswith("_no_mul")


@dataclass(frozen=True, slots=True)
class ParallelSpec:
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    enable_expert_parallel: bool = False
    all2all_backend: str = "allgather_reducescatter"
    enable_eplb: bool = False


@dataclass(frozen=True, slots=True)
class DeploymentSpec:
    """A fully resolved deployment: every default applied, the platform a profile."""

    hf_quantization_config: Mapping[str, Any]
    layer: LayerSpec
    platform: PlatformProfile
    quantization: str | None = None
    parallel: ParallelSpec = field(default_factory=ParallelSpec)
    lora: bool = False
    moe_backend: str = "auto"
    #: The ruleset the spec names, resolved to its canonical name; None: the caller's
    #: choice (a request field, `--ruleset`), else the newest release.
    ruleset: str | None = None

    def to_json(self) -> dict[str, Any]:
        """The normalised JSON form: every field present, the platform explicit (the
        ruleset only where the spec names one, so a spec that does not stays as it was)."""
        routing = self.layer.routing
        named = {} if self.ruleset is None else {"ruleset": self.ruleset}
        return {
            "hf_quantization_config": dict(self.hf_quantization_config),
            "quantization": self.quantization,
            "layer": {
                "name": self.layer.name,
                "num_experts": self.layer.num_experts,
                "top_k": self.layer.top_k,
                "hidden_size": self.layer.hidden_size,
                "intermediate_size": self.layer.intermediate_size,
                "activation": self.layer.activation,
                "has_bias": self.layer.has_bias,
                "dtype": self.layer.dtype,
                "routing": {
                    "scoring_func": routing.scoring_func,
                    "renormalize": routing.renormalize,
                    "use_grouped_topk": routing.use_grouped_topk,
                    "num_expert_group": routing.num_expert_group,
                    "topk_group": routing.topk_group,
                    "e_score_correction_bias": routing.e_score_correction_bias,
                    "routed_scaling_factor": routing.routed_scaling_factor,
                    "router_logits_dtype": routing.router_logits_dtype,
                },
            },
            "parallel": {
                "tensor_parallel_size": self.parallel.tensor_parallel_size,
                "data_parallel_size": self.parallel.data_parallel_size,
                "enable_expert_parallel": self.parallel.enable_expert_parallel,
                "all2all_backend": self.parallel.all2all_backend,
                "enable_eplb": self.parallel.enable_eplb,
            },
            "lora": self.lora,
            "platform": self.platform.to_json(),
            "moe_backend": self.moe_backend,
            **named,
        }


class _Reader:
    """Reads typed fields out of a JSON object, collecting violations instead of raising."""

    def __init__(self, obj: Mapping[str, Any], prefix: str, allowed: tuple[str, ...]) -> None:
        self.obj = obj
        self.prefix = prefix
        self.violations: list[FieldViolation] = [
            FieldViolation(self.path(key), f"unknown field; allowed: {list(allowed)}")
            for key in obj
            if key not in allowed
        ]

    def path(self, key: str) -> str:
        return f"{self.prefix}.{key}" if self.prefix else key

    def fail(self, key: str, description: str) -> None:
        self.violations.append(FieldViolation(self.path(key), description))

    def int_(self, key: str, default: int | None = None, *, minimum: int = 1) -> int:
        value = self.obj.get(key, default)
        if value is None:
            self.fail(key, "required: a positive integer")
            return minimum
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            self.fail(key, f"must be an integer >= {minimum}, got {value!r}")
            return minimum
        if value > MAX_SIZE:
            self.fail(key, f"must be at most {MAX_SIZE} (a 32-bit size), got {value}")
            return minimum
        return value

    def optional_int(self, key: str) -> int | None:
        if self.obj.get(key) is None:
            return None
        return self.int_(key, minimum=0)

    def bool_(self, key: str, default: bool) -> bool:
        value = self.obj.get(key, default)
        if value is None:
            return default
        if not isinstance(value, bool):
            self.fail(key, f"must be true or false, got {value!r}")
            return default
        return value

    def float_(self, key: str, default: float) -> float:
        value = self.obj.get(key, default)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, int | float):
            self.fail(key, f"must be a number, got {value!r}")
            return default
        if not abs(value) <= MAX_SIZE:  # NaN compares false: refused with the infinities
            self.fail(key, f"must be a finite number of magnitude <= {MAX_SIZE}, got {value!r}")
            return default
        return float(value)

    def choice(self, key: str, choices: tuple[str, ...], default: str | None) -> str | None:
        value = self.obj.get(key, default)
        if value is None:
            return None
        if value not in choices:
            self.fail(key, f"must be one of {list(choices)}, got {value!r}")
            return default
        return str(value)

    def string(self, key: str, default: str) -> str:
        value = self.obj.get(key, default)
        if value is None:
            return default
        if not isinstance(value, str) or not value:
            self.fail(key, f"must be a non-empty string, got {value!r}")
            return default
        return value

    def mapping(self, key: str) -> Mapping[str, Any]:
        value = self.obj.get(key)
        if value is None:
            return {}
        if not isinstance(value, Mapping):
            self.fail(key, "must be a JSON object")
            return {}
        return value


_TOP_FIELDS = (
    "hf_quantization_config",
    "quantization",
    "layer",
    "parallel",
    "platform",
    "moe_backend",
    "lora",
    "ruleset",
    "id",
)
_LAYER_FIELDS = (
    "name",
    "num_experts",
    "top_k",
    "hidden_size",
    "intermediate_size",
    "activation",
    "has_bias",
    "dtype",
    "routing",
)
_ROUTING_FIELDS = (
    "scoring_func",
    "renormalize",
    "use_grouped_topk",
    "num_expert_group",
    "topk_group",
    "e_score_correction_bias",
    "routed_scaling_factor",
    "router_logits_dtype",
)
_PARALLEL_FIELDS = (
    "tensor_parallel_size",
    "data_parallel_size",
    "enable_expert_parallel",
    "all2all_backend",
    "enable_eplb",
)


def _parse_routing(obj: Mapping[str, Any], violations: list[FieldViolation]) -> RoutingSpec:
    reader = _Reader(obj, "layer.routing", _ROUTING_FIELDS)
    routing = RoutingSpec(
        scoring_func=reader.choice("scoring_func", SCORING_FUNCS, "softmax") or "softmax",
        renormalize=reader.bool_("renormalize", True),
        use_grouped_topk=reader.bool_("use_grouped_topk", False),
        num_expert_group=reader.optional_int("num_expert_group"),
        topk_group=reader.optional_int("topk_group"),
        e_score_correction_bias=reader.bool_("e_score_correction_bias", False),
        routed_scaling_factor=reader.float_("routed_scaling_factor", 1.0),
        router_logits_dtype=reader.choice("router_logits_dtype", ROUTER_LOGITS_DTYPES, None),
    )
    violations.extend(reader.violations)
    return routing


def _parse_layer(obj: Mapping[str, Any], violations: list[FieldViolation]) -> LayerSpec:
    reader = _Reader(obj, "layer", _LAYER_FIELDS)
    checked = len(reader.violations)
    num_experts = reader.int_("num_experts")
    top_k = reader.int_("top_k")
    both_valid = len(reader.violations) == checked
    if top_k > num_experts and both_valid and "top_k" in obj and "num_experts" in obj:
        reader.fail("top_k", f"must not exceed num_experts ({num_experts}), got {top_k}")
    layer = LayerSpec(
        num_experts=num_experts,
        top_k=top_k,
        hidden_size=reader.int_("hidden_size"),
        intermediate_size=reader.int_("intermediate_size"),
        activation=reader.choice("activation", ACTIVATIONS, "silu") or "silu",
        has_bias=reader.bool_("has_bias", False),
        dtype=reader.choice("dtype", DTYPES, "bfloat16") or "bfloat16",
        name=reader.string("name", DEFAULT_LAYER_NAME),
        routing=_parse_routing(reader.mapping("routing"), violations),
    )
    violations.extend(reader.violations)
    return layer


def _parse_parallel(obj: Mapping[str, Any], violations: list[FieldViolation]) -> ParallelSpec:
    reader = _Reader(obj, "parallel", _PARALLEL_FIELDS)
    parallel = ParallelSpec(
        tensor_parallel_size=reader.int_("tensor_parallel_size", 1),
        data_parallel_size=reader.int_("data_parallel_size", 1),
        enable_expert_parallel=reader.bool_("enable_expert_parallel", False),
        all2all_backend=reader.choice("all2all_backend", ALL2ALL_BACKENDS, None)
        or "allgather_reducescatter",
        enable_eplb=reader.bool_("enable_eplb", False),
    )
    violations.extend(reader.violations)
    return parallel


def _parse_platform(value: Any, violations: list[FieldViolation]) -> PlatformProfile | None:
    try:
        if isinstance(value, str):
            return preset(value)
        if isinstance(value, Mapping):
            if set(value) == {"preset"} or ("preset" in value and isinstance(value["preset"], str)):
                base = preset(value["preset"], field_name="platform.preset")
                extra = {k: v for k, v in value.items() if k != "preset"}
                merged = {**base.to_json(), **extra}
                return PlatformProfile.from_json(merged)
            return PlatformProfile.from_json(value)
    except InvalidSpecError as exc:
        violations.extend(exc.violations)
        return None
    violations.append(
        FieldViolation("platform", "must be a preset name (e.g. 'h100') or a platform object")
    )
    return None


def _parse_ruleset(value: Any, violations: list[FieldViolation]) -> str | None:
    """`ruleset`: the vLLM release that decides, in any form the resolver accepts."""
    if value is None or value == "":
        return None
    if not isinstance(value, str):
        violations.append(FieldViolation("ruleset", "must be a string such as 'vllm-0.33'"))
        return None
    try:
        return resolve_ruleset(value)
    except InvalidSpecError as exc:
        violations.extend(exc.violations)
        return None


def parse_deployment(
    obj: Mapping[str, Any], *, default_platform: PlatformProfile | None = None
) -> DeploymentSpec:
    """Validate a deployment spec and apply every default.

    `default_platform` stands in when the spec names none (the serving worker's own profile
    in the server; a required field in the library and CLI).
    """
    if not isinstance(obj, Mapping):
        raise InvalidSpecError.single("", "a deployment spec must be a JSON object")
    top = _Reader(obj, "", _TOP_FIELDS)
    violations = top.violations
    quant_config = obj.get("hf_quantization_config")
    if not isinstance(quant_config, Mapping) or not quant_config:
        violations.append(
            FieldViolation(
                "hf_quantization_config",
                "required: the quantization_config object of the model's config.json",
            )
        )
        quant_config = {}
    layer_obj = obj.get("layer")
    if not isinstance(layer_obj, Mapping):
        violations.append(
            FieldViolation(
                "layer",
                "required: an object with num_experts, top_k, hidden_size, intermediate_size",
            )
        )
        layer_obj = {}
    layer = _parse_layer(layer_obj, violations)
    parallel = _parse_parallel(top.mapping("parallel"), violations)
    platform: PlatformProfile | None
    if obj.get("platform") is None:
        platform = default_platform
        if platform is None:
            violations.append(
                FieldViolation("platform", "required: a preset name (e.g. 'h100') or an object")
            )
    else:
        platform = _parse_platform(obj["platform"], violations)
    quantization = top.choice("quantization", USER_QUANTIZATIONS, None)
    moe_backend = obj.get("moe_backend", "auto")
    if moe_backend is None:
        moe_backend = "auto"
    if not isinstance(moe_backend, str) or not moe_backend:
        violations.append(FieldViolation("moe_backend", "must be a non-empty string"))
        moe_backend = "auto"
    lora = top.bool_("lora", False)
    ruleset = _parse_ruleset(obj.get("ruleset"), violations)
    if parallel.enable_eplb and not parallel.enable_expert_parallel:
        violations.append(
            FieldViolation("parallel.enable_eplb", "needs enable_expert_parallel: true")
        )
    if parallel.enable_eplb and platform is not None and platform.device == "cpu":
        violations.append(
            FieldViolation(
                "parallel.enable_eplb",
                "vLLM supports expert load balancing only on CUDA, ROCm and XPU devices",
            )
        )
    if violations or platform is None:
        raise InvalidSpecError(violations)
    return DeploymentSpec(
        hf_quantization_config=dict(quant_config),
        layer=layer,
        platform=platform,
        quantization=quantization,
        parallel=parallel,
        lora=lora,
        moe_backend=moe_backend,
        ruleset=ruleset,
    )
