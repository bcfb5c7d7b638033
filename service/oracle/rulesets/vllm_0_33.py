"""vLLM 0.33.0's WNA16 MoE backend rules (`fused_moe/oracle/int_wna16.py` and the experts).

Read from the installed 0.33.0 source: the backend enum and priority list (with
`prioritize_humming`, which moves HUMMING ahead of MARLIN on SM90), the structural rules of
`_backend_incompatibility_reason` in their order, and each experts class's support checks.
Reason texts are vLLM's, character for character; codes are ours and stable.
"""

from __future__ import annotations

from service.oracle.conversions import ConversionRules
from service.oracle.moe_config import (
    BATCHED_FORMAT,
    STANDARD_FORMAT,
    MoEConfig,
    MoEParallelConfig,
)
from service.oracle.platform import DECISION_ENV_FLAGS, STARTUP_ENV_FLAGS, PlatformProfile
from service.oracle.quant_key import (
    K_INT4_STATIC,
    K_INT4_STATIC_32,
    K_INT4_STATIC_32_ASYM,
    K_INT4_STATIC_ASYM,
    K_INT8_STATIC,
    PER_CHANNEL,
    QuantKey,
)
from service.oracle.quant_method import (
    AwqConfig,
    GptqConfig,
    MoeWNA16Config,
    WeightArgs,
    marlin_supports,
)
from service.oracle.releases import RELEASES
from service.oracle.rulesets.base import (
    ExpertsClass,
    Priority,
    RuleContext,
    Ruleset,
    StructuralRule,
)
from service.oracle.rulesets.kernel_names import MOE_BACKENDS_0_33

NAME = "vllm-0.33"

# --- devices ---------------------------------------------------------------------------------


def _cuda_at_least_75(p: PlatformProfile) -> bool:
    return p.device == "cuda" and p.capability_int >= 75


def _cuda_alike(p: PlatformProfile) -> bool:
    return p.device in ("cuda", "rocm")


def _flashinfer_mxint4(p: PlatformProfile) -> bool:
    flag = bool(int(p.env_flag("VLLM_USE_FLASHINFER_MOE_INT4", "0") or "0"))
    return (
        p.device == "cuda" and p.capability_int // 10 == 10 and flag and p.has_package("flashinfer")
    )


def _humming_device(p: PlatformProfile) -> bool:
    return p.has_package("humming") and _cuda_at_least_75(p)


def _cpu_amx(p: PlatformProfile) -> bool:
    return p.device == "cpu" and p.x86 and p.amx


def _zentorch(p: PlatformProfile) -> bool:
    return p.device == "cpu" and p.has_package("zentorch")


def _rdna3(p: PlatformProfile) -> bool:
    return p.device == "rocm" and (p.arch or "").startswith("gfx1100")


# --- activations -----------------------------------------------------------------------------

#: `apply_moe_activation_supported` (and the masked variant, which accepts the same set).
APPLY_ACTIVATIONS = frozenset(
    {
        "silu",
        "gelu",
        "gelu_tanh",
        "situ",
        "swigluoai",
        "swigluoai_uninterleave",
        "swiglustep",
        "silu_no_mul",
        "gelu_no_mul",
        "gelu_tanh_no_mul",
        "relu2_no_mul",
    }
)
TRITON_WNA16_ACTIVATIONS = APPLY_ACTIVATIONS - {"situ"}

# --- quant schemes ---------------------------------------------------------------------------

_MARLIN_KEYS = frozenset(
    {K_INT4_STATIC, K_INT8_STATIC, K_INT4_STATIC_32, K_INT4_STATIC_ASYM, K_INT4_STATIC_32_ASYM}
)
_EMULATION_KEYS = frozenset(
    {K_INT4_STATIC, K_INT4_STATIC_32, K_INT4_STATIC_ASYM, K_INT4_STATIC_32_ASYM}
)


def _in(*keys: QuantKey) -> frozenset[QuantKey]:
    return frozenset(keys)


def _humming_key(key: QuantKey) -> bool:
    """Humming's explicit list, or any unsigned-int 2..8-bit key grouped per channel or (1,g)."""
    if key in (K_INT4_STATIC, K_INT8_STATIC):
        return True
    rows, cols = key.group_shape
    if not (key.group_shape == PER_CHANNEL or (rows == 1 and cols > 0)):
        return False
    return key.is_unsigned_int and 2 <= key.bits <= 8


# --- parallel configs ------------------------------------------------------------------------


def _no_fi_nvl_two_sided(pc: MoEParallelConfig) -> bool:
    return not pc.use_fi_nvl_two_sided_kernels


def _no_fi_nvl(pc: MoEParallelConfig) -> bool:
    return not (pc.use_fi_nvl_two_sided_kernels or pc.use_fi_nvl_one_sided_kernels)


def _any_parallel(pc: MoEParallelConfig) -> bool:
    return True


def _trtllm_parallel(pc: MoEParallelConfig) -> bool:
    return (not pc.use_all2all_kernels or pc.use_ag_rs_all2all_kernels) and not pc.enable_eplb


def _no_ep(pc: MoEParallelConfig) -> bool:
    return not pc.use_ep


# --- class-specific checks -------------------------------------------------------------------


def _triton_expert_count(ctx: RuleContext) -> tuple[str, str] | None:
    """TritonExperts: moe_align_block_size caps the padded expert count on CUDA and ROCm."""
    if not _cuda_alike(ctx.platform):
        return None
    if (ctx.moe.num_experts + 31) // 32 * 32 >= 1024:
        return (
            "EXPERT_COUNT",
            "kernel's moe_align_block_size requires fewer than 1024 padded experts",
        )
    return None


def _preferred_humming_gemm(ctx: RuleContext) -> str:
    env = ctx.platform.env_flag("VLLM_HUMMING_MOE_GEMM_TYPE")
    if env is not None and env.lower() != "auto":
        env = env.lower()
        return "grouped_contiguous" if env == "grouped" else env
    return "grouped_contiguous" if ctx.moe.parallel.use_ep else "indexed"


def _humming_gemm(gemm_type: str) -> tuple[object, ...]:
    def check(ctx: RuleContext) -> tuple[str, str] | None:
        preferred = _preferred_humming_gemm(ctx)
        if preferred.lower() == gemm_type:
            return None
        return (
            "HUMMING_GEMM_TYPE",
            f"preferred gemm type {preferred} != supported gemm type {gemm_type}",
        )

    return (check,)


def _zentorch_inputs(ctx: RuleContext) -> tuple[str, str] | None:
    if ctx.moe.in_dtype != "bfloat16":
        return "BF16_REQUIRED", "kernel requires bfloat16 activations"
    if ctx.moe.experts_per_token < 2:
        return "TOP_K_TOO_SMALL", "kernel requires experts_per_token >= 2"
    return None


def _trtllm_router_logits(dtype: str, routing: str) -> bool:
    return routing == "DeepSeekV3" if dtype == "float32" else True


# --- experts classes -------------------------------------------------------------------------

MARLIN = ExpertsClass(
    "MarlinExperts",
    _cuda_at_least_75,
    True,
    APPLY_ACTIVATIONS,
    _MARLIN_KEYS.__contains__,
    _no_fi_nvl_two_sided,
    lora=True,
)
BATCHED_MARLIN = ExpertsClass(
    "BatchedMarlinExperts",
    _cuda_at_least_75,
    True,
    APPLY_ACTIVATIONS,
    _MARLIN_KEYS.__contains__,
    _no_fi_nvl_two_sided,
    activation_format="batched_experts",
)
TRITON_WNA16 = ExpertsClass(
    "TritonWNA16Experts",
    lambda p: _cuda_alike(p) or p.device == "xpu",
    True,
    TRITON_WNA16_ACTIVATIONS,
    _MARLIN_KEYS.__contains__,
    _no_fi_nvl,
    batch_invariant=True,
    lora=True,
    extra_checks=(_triton_expert_count,),
)
EMULATION = ExpertsClass(
    "Int4EmulationTritonExperts",
    _cuda_alike,
    True,
    APPLY_ACTIVATIONS,
    _EMULATION_KEYS.__contains__,
    _no_fi_nvl,
    batch_invariant=True,
    lora=True,
    extra_checks=(_triton_expert_count,),
)
TRTLLM_MXINT4 = ExpertsClass(
    "TrtLlmMxint4ExpertsMonolithic",
    _flashinfer_mxint4,
    False,
    frozenset({"silu", "swigluoai"}),
    _in(K_INT4_STATIC_32).__contains__,
    _trtllm_parallel,
    monolithic=True,
    routing_methods=frozenset({"Renormalize", "RenormalizeNaive", "DeepSeekV3", "Llama4"}),
    supports_router_logits=_trtllm_router_logits,
)
CPU_INT4 = ExpertsClass(
    "CPUExpertsInt4",
    _cpu_amx,
    False,
    frozenset({"silu", "gelu_tanh"}),
    _in(K_INT4_STATIC).__contains__,
    _any_parallel,
    routing_methods=frozenset({"Default", "Renormalize", "RenormalizeNaive"}),
)
ZENTORCH_INT4 = ExpertsClass(
    "ZentorchExpertsInt4",
    _zentorch,
    False,
    frozenset({"gelu", "gelu_tanh", "silu", "swigluoai"}),
    _in(K_INT4_STATIC, K_INT4_STATIC_32).__contains__,
    _no_ep,
    monolithic=True,
    routing_methods=frozenset({"Default", "Renormalize", "RenormalizeNaive", "Custom"}),
    extra_checks=(_zentorch_inputs,),
)
XPU_WNA16 = ExpertsClass(
    "XPUExpertsWNA16",
    lambda p: p.device == "xpu",
    True,
    frozenset({"silu", "gelu", "gelu_tanh", "swigluoai", "relu2_no_mul"}),
    _in(K_INT4_STATIC, K_INT4_STATIC_32).__contains__,
    _any_parallel,
)
RDNA3_WNA16 = ExpertsClass(
    "Rdna3WNA16Experts",
    _rdna3,
    True,
    APPLY_ACTIVATIONS,
    _in(K_INT4_STATIC, K_INT4_STATIC_32).__contains__,
    _no_fi_nvl,
)


def _humming(name: str, gemm_type: str, activation_format: str) -> ExpertsClass:
    return ExpertsClass(
        name,
        _humming_device,
        True,
        APPLY_ACTIVATIONS,
        _humming_key,
        _any_parallel,
        activation_format=activation_format,
        batch_invariant=True,
        extra_checks=_humming_gemm(gemm_type),  # type: ignore[arg-type]
    )


EXPERTS_CLASSES: dict[str, tuple[ExpertsClass, ...]] = {
    "MARLIN": (MARLIN,),
    "BATCHED_MARLIN": (BATCHED_MARLIN,),
    "HUMMING": (
        _humming("BatchedHummingGroupedExperts", "grouped_masked", "batched_experts"),
        _humming("HummingGroupedExperts", "grouped_contiguous", "standard"),
        _humming("HummingIndexedExperts", "indexed", "standard"),
    ),
    "CPU": (CPU_INT4,),
    "ZEN_CPU": (ZENTORCH_INT4,),
    "FLASHINFER_TRTLLM": (TRTLLM_MXINT4,),
    "TRITON": (TRITON_WNA16,),
    "XPU": (XPU_WNA16,),
    "EMULATION": (EMULATION,),
    "RDNA3": (RDNA3_WNA16,),
}

# --- structural rules (`_backend_incompatibility_reason`, top-down, first hit wins) ----------


def _is_ct(ctx: RuleContext) -> bool:
    return isinstance(ctx.quant_config, WeightArgs)


def _ct_group_actorder(ctx: RuleContext) -> bool:
    return isinstance(ctx.quant_config, WeightArgs) and ctx.quant_config.actorder == "group"


def _gptq_desc_act(ctx: RuleContext) -> bool:
    return isinstance(ctx.quant_config, GptqConfig) and ctx.quant_config.desc_act


def _is_moe_wna16(ctx: RuleContext) -> bool:
    return isinstance(ctx.quant_config, MoeWNA16Config)


def _group_size(ctx: RuleContext) -> int | None:
    return ctx.quant_config.group_size


def _zen_group_missing(ctx: RuleContext) -> bool:
    group_size = _group_size(ctx)
    return group_size is None or group_size <= 0


def _marlin_rejects_layer(ctx: RuleContext) -> bool:
    if isinstance(ctx.quant_config, MoeWNA16Config):
        return False
    if not isinstance(ctx.quant_config, AwqConfig | GptqConfig | WeightArgs):
        return True
    group_size = -1 if ctx.quant_config.group_size is None else ctx.quant_config.group_size
    return not marlin_supports(ctx.moe, group_size, ctx.allow_tile_padding, ctx.platform)


def _rule(backends: str, applies: object, code: str, reason: object) -> StructuralRule:
    return StructuralRule(frozenset(backends.split()), applies, code, reason)  # type: ignore[arg-type]


STRUCTURAL_RULES: tuple[StructuralRule, ...] = (
    _rule(
        "FLASHINFER_TRTLLM",
        lambda c: c.may_have_zp or c.may_have_bias,
        "ZERO_POINTS_OR_BIAS",
        "zero points and bias are not supported",
    ),
    _rule(
        "RDNA3",
        lambda c: not _is_ct(c),
        "COMPRESSED_TENSORS_ONLY",
        "only compressed-tensors checkpoints are supported",
    ),
    _rule(
        "RDNA3", lambda c: c.may_have_zp, "ASYMMETRIC", "asymmetric checkpoints are not supported"
    ),
    _rule("RDNA3", lambda c: c.may_have_bias, "EXPERT_BIAS", "expert bias is not supported"),
    _rule(
        "RDNA3", _ct_group_actorder, "GROUP_ACT_ORDER", "group activation ordering is not supported"
    ),
    _rule(
        "RDNA3",
        lambda c: c.quant_config.strategy != "group",
        "GROUP_SCALES_ONLY",
        "only group-wise scales are supported",
    ),
    _rule(
        "ZEN_CPU",
        lambda c: not c.env_bool("VLLM_CPU_INT4_W4A8", "1"),
        "DISABLED_BY_ENV",
        "VLLM_CPU_INT4_W4A8=0 disables the DA8W4 path",
    ),
    _rule("ZEN_CPU", lambda c: c.may_have_zp, "ZERO_POINTS", "zero points are not supported"),
    _rule(
        "ZEN_CPU",
        _is_moe_wna16,
        "MOE_WNA16_LAYOUT",
        "the MoeWNA16 weight layout is not supported",
    ),
    _rule("ZEN_CPU", _gptq_desc_act, "GPTQ_ACT_ORDER", "GPTQ activation ordering is not supported"),
    _rule(
        "ZEN_CPU",
        _ct_group_actorder,
        "GROUP_ACT_ORDER",
        "group activation ordering is not supported",
    ),
    _rule(
        "ZEN_CPU",
        _zen_group_missing,
        "GROUP_QUANT_REQUIRED",
        "DA8W4 requires group-quantized weights",
    ),
    _rule(
        "ZEN_CPU",
        lambda c: (_group_size(c) or 0) % 4 != 0,
        "GROUP_SIZE_MULTIPLE_OF_4",
        lambda c: f"group size {_group_size(c)} is not a multiple of 4",
    ),
    _rule("TRITON", lambda c: c.may_have_bias, "EXPERT_BIAS", "expert bias is not supported"),
    _rule(
        "TRITON",
        lambda c: isinstance(c.quant_config, AwqConfig),
        "AWQ_LAYOUT",
        "the AutoAWQ weight layout is not supported",
    ),
    _rule("TRITON", _gptq_desc_act, "GPTQ_ACT_ORDER", "GPTQ activation ordering is not supported"),
    _rule(
        "TRITON",
        _ct_group_actorder,
        "GROUP_ACT_ORDER",
        "group activation ordering is not supported",
    ),
    _rule(
        "MARLIN BATCHED_MARLIN",
        _marlin_rejects_layer,
        "MARLIN_LAYER_UNSUPPORTED",
        "Marlin not supported for this layer",
    ),
    _rule(
        "MARLIN BATCHED_MARLIN EMULATION",
        _is_moe_wna16,
        "MOE_WNA16_LAYOUT",
        "the MoeWNA16 checkpoint layout is not supported",
    ),
)

# --- the all2all backends and the activation format they hand the experts ------------------

#: `vllm/config/parallel.py`'s `All2AllBackend` literal, in its order. Every release from 0.27
#: has `deepep_v2` (and hands it over in the standard format up to 0.33).
ALL2ALL_BACKENDS: tuple[str, ...] = (
    "naive",
    "pplx",
    "deepep_high_throughput",
    "deepep_low_latency",
    "deepep_v2",
    "mori_high_throughput",
    "mori_low_latency",
    "moonep",
    "nixl_ep",
    "allgather_reducescatter",
    "flashinfer_all2allv",
    "flashinfer_nvlink_two_sided",
    "flashinfer_nvlink_one_sided",
    "passthrough",
)


def activation_format(moe: MoEConfig) -> str:
    """`select_wna16_moe_backend`'s format: batched for DeepEP low-latency and NIXL EP
    (`use_batched_activation_format`), standard otherwise."""
    return BATCHED_FORMAT if moe.parallel.use_batched_activation_format else STANDARD_FORMAT


# --- priority --------------------------------------------------------------------------------

#: `_get_priority_backends` for CUDA and ROCm, before `prioritize_humming` reorders it.
GPU_PRIORITY = (
    "RDNA3",
    "FLASHINFER_TRTLLM",
    "MARLIN",
    "BATCHED_MARLIN",
    "TRITON",
    "HUMMING",
    "EMULATION",
)
#: `prefers_humming`: compute capabilities where HUMMING is moved directly ahead of MARLIN.
HUMMING_PREFERRED_CAPABILITIES = frozenset({90})

PRIORITY = Priority(
    gpu=GPU_PRIORITY,
    cpu=("ZEN_CPU", "CPU"),
    xpu=("XPU",),
    humming_preferred_capabilities=HUMMING_PREFERRED_CAPABILITIES,
)


RULESET = Ruleset(
    name=NAME,
    release=RELEASES[NAME],
    backends=(
        "MARLIN",
        "BATCHED_MARLIN",
        "HUMMING",
        "CPU",
        "ZEN_CPU",
        "FLASHINFER_TRTLLM",
        "TRITON",
        "XPU",
        "EMULATION",
        "RDNA3",
    ),
    experts_classes=EXPERTS_CLASSES,
    structural_rules=STRUCTURAL_RULES,
    user_backends={
        "triton": "TRITON",
        "marlin": "MARLIN",
        "humming": "HUMMING",
        "flashinfer_trtllm": "FLASHINFER_TRTLLM",
        "emulation": "EMULATION",
        "rdna3": "RDNA3",
    },
    kernel_config_moe_backends=MOE_BACKENDS_0_33,
    priority=PRIORITY,
    activation_format=activation_format,
    all2all_backends=ALL2ALL_BACKENDS,
    # Marlin still converts for int8 and fp8 activations (VLLM_MARLIN_INPUT_DTYPE).
    conversions=ConversionRules(marlin_8bit_activations=True),
    # The start-up flags too: 0.33 and older start whatever they say (0.34 refuses some).
    env_flags=frozenset({*DECISION_ENV_FLAGS, *STARTUP_ENV_FLAGS}),
    # ParallelConfig: EPLB needs `is_cuda_alike() or is_xpu()`.
    class_check_codes=(
        # FusedMoEExperts.is_supported_config, in its order (service.oracle.engine)
        "DEVICE",
        "NON_GATED",
        "ACTIVATION",
        "QUANT_SCHEME",
        "PARALLEL_CONFIG",
        "ROUTING_METHOD",
        "ROUTER_LOGITS_DTYPE",
        "ACTIVATION_FORMAT",
        "BATCH_INVARIANCE",
        "LORA",
        # the classes' own checks (above)
        "EXPERT_COUNT",
        "HUMMING_GEMM_TYPE",
        "BF16_REQUIRED",
        "TOP_K_TOO_SMALL",
    ),
)
