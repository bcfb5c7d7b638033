"""vLLM 0.29.0's WNA16 MoE backend rules: 0.30.0's, with the rows 0.29.0's source differs in.

Read from the installed 0.29.0 wheel beside 0.30.0's (paths inside the wheel; O is
`vllm/model_executor/layers/fused_moe/oracle/int_wna16.py`, Q is
`vllm/model_executor/layers/quantization/`). The oracle's core (the select function, the
FLASHINFER_TRTLLM / TRITON / Marlin / MoeWNA16 rules and their strings, every experts
class's checks but Humming's gemm type) is 0.30's; these rows differ:

- No RDNA3 backend (O:51 enum, O:108 priority, O:127 no RDNA3 rule block, O:182 no `rdna3`
  mapping), and KernelConfig's `MoEBackend` (`vllm/config/kernel.py:122`) lacks `rdna3` and
  `aiter_triton_mxfp4_bf16`, so `--moe-backend rdna3` is refused before any quantization
  code runs.
- The Marlin rule reads `quant_config.group_size` as it is (O:163): a compressed-tensors
  per-channel scheme leaves it None, and `check_moe_marlin_supports_config`
  (`Q/utils/marlin_utils.py:355`) then compares None with an int on CUDA when the hidden
  size is a multiple of 128. vLLM raises that TypeError out of the oracle; here the rule
  raises the same error (stage `backend`, no candidates: vLLM gives none).
- `get_humming_moe_gemm_type()` takes no MoE config
  (`fused_moe/experts/fused_humming_moe.py:106`): VLLM_HUMMING_MOE_GEMM_TYPE "grouped" or
  "grouped_contiguous" (any case) prefers grouped_contiguous, anything else (unset, "auto")
  indexed; expert parallelism does not change it.
- Activation ordering is still supported (`IntegrationRules.act_order_supported`):
  AutoGPTQ keeps `desc_act` unless group_size is -1 (`Q/auto_gptq.py:118`) and its dynamic
  overrides are not reset (`Q/utils/gptq_utils.py:25`), and passes
  `allow_tile_padding=not desc_act` to the Marlin layer check and the oracle (247, 495);
  compressed-tensors keeps group and dynamic `actorder`, passes
  `allow_tile_padding=not is_actorder` and asserts `actorder != "group"` on non-Marlin
  backends (`Q/compressed_tensors/compressed_tensors_moe/compressed_tensors_moe_wna16.py`
  103, 136); MoeWNA16's compatibility check reads the raw `desc_act` (`Q/moe_wna16.py:162`)
  and its config does not validate it. So TRITON's group act-order rule is live here (its
  GPTQ act-order rule is not: AutoGPTQ always passes `may_have_bias`, which TRITON's bias
  rule refuses first).
- On ROCm, a 4-bit compressed-tensors scheme on gfx1100 builds
  `CompressedTensorsWNA16RDNA3MoEMethod` ahead of everything else
  (`Q/compressed_tensors/compressed_tensors_moe/compressed_tensors_moe.py:93`,
  `rocm_moe_rdna.py`); it inherits the WNA16 method's constructor, so the oracle still runs
  (normally choosing TRITON) and its choice is what vLLM reports, though the layer then runs
  the RDNA3 HIP kernel.
- XPU's `supported_quantization` (`vllm/platforms/xpu.py:113`) lacks "moe_wna16".
- Quark's MoE method hands its scheme predicates the `weight` / `input_tensors` lists as
  they are (`quark_moe.py`; 0.30 added `_unwrap_single_quant_config`), so a list weight of
  any length but two fails on the first predicate that reads it with AttributeError
  ("'list' object has no attribute 'get'").

What the spec cannot express: compressed-tensors' weight key for a 2/3/5/6/7-bit
per-channel scheme is built from the unnormalised None group size
(`GroupShape(row=1, col=None)`); the oracle models a per-channel key there. What happens
after the MoE method is built is a hazard, not the answer: the gfx1100 method's inherited
`create_weights` pops `intermediate_size_full`, which the layer
(`fused_moe/routed_experts.py:209`) passes only to the methods it names
(`CT_RDNA3_METHOD_LOAD_FAILS`), and g_idx is dropped for compressed-tensors' `dynamic`
act-order and by MoeWNA16 (`CT_DYNAMIC_ACT_ORDER_DROPPED`, `MOE_WNA16_DROPS_ACT_ORDER`).
"""

from __future__ import annotations

import dataclasses
from types import MappingProxyType

from service.oracle.quant_method import (
    CT_RDNA3_METHOD,
    AwqConfig,
    GptqConfig,
    IntegrationRules,
    MoeWNA16Config,
    WeightArgs,
    marlin_supports,
    vllm_error,
)
from service.oracle.releases import RELEASES
from service.oracle.rulesets import vllm_0_30 as base
from service.oracle.rulesets.base import (
    Check,
    ExpertsClass,
    Priority,
    RuleContext,
    Ruleset,
    StructuralRule,
)
from service.oracle.rulesets.kernel_names import MOE_BACKENDS_0_29

NAME = "vllm-0.29"

#: The backend 0.30 added to the oracle, absent here.
ADDED_IN_0_30 = "RDNA3"

# --- Humming's gemm type ---------------------------------------------------------------------

#: `humming_gemm_type()` of each Humming experts class.
HUMMING_GEMM_TYPES = {
    "BatchedHummingGroupedExperts": "grouped_masked",
    "HummingGroupedExperts": "grouped_contiguous",
    "HummingIndexedExperts": "indexed",
}


def preferred_humming_gemm(ctx: RuleContext) -> str:
    """`get_humming_moe_gemm_type()`: the env flag alone decides."""
    env = ctx.platform.env_flag("VLLM_HUMMING_MOE_GEMM_TYPE")
    if env is not None and env.lower() in ("grouped", "grouped_contiguous"):
        return "grouped_contiguous"
    return "indexed"


def _humming_gemm_check(gemm_type: str) -> Check:
    def check(ctx: RuleContext) -> tuple[str, str] | None:
        preferred = preferred_humming_gemm(ctx)
        if preferred == gemm_type:
            return None
        return (
            "HUMMING_GEMM_TYPE",
            f"preferred gemm type {preferred} != supported gemm type {gemm_type}",
        )

    return check


def _humming_class(cls: ExpertsClass) -> ExpertsClass:
    check = _humming_gemm_check(HUMMING_GEMM_TYPES[cls.name])
    return dataclasses.replace(cls, extra_checks=(check,))


# --- the Marlin rule without group-size normalisation ----------------------------------------


def _none_compared(operator: str) -> str:
    return f"'{operator}' not supported between instances of 'NoneType' and 'int'"


def _marlin_rejects_layer(ctx: RuleContext) -> bool:
    """The 0.30 Marlin rule, but a None group size reaches `check_moe_marlin_supports_config`
    as it is: past its ROCm and hidden-size tests it is compared with an int (`<= 0` with
    tile padding, `max(64, ...)` without), which raises TypeError out of the oracle."""
    config = ctx.quant_config
    if isinstance(config, MoeWNA16Config):
        return False
    if not isinstance(config, AwqConfig | GptqConfig | WeightArgs):
        return True
    if config.group_size is not None:
        return not marlin_supports(ctx.moe, config.group_size, ctx.allow_tile_padding, ctx.platform)
    if ctx.platform.device == "rocm" or ctx.moe.hidden_dim % 128 != 0:
        return True
    raise vllm_error(
        "backend", "TypeError", _none_compared("<=" if ctx.allow_tile_padding else ">")
    )


MARLIN_RULE_CODE = "MARLIN_LAYER_UNSUPPORTED"


def _structural_rules() -> tuple[StructuralRule, ...]:
    return tuple(
        dataclasses.replace(rule, applies=_marlin_rejects_layer)
        if rule.code == MARLIN_RULE_CODE
        else rule
        for rule in base.RULESET.structural_rules
        if rule.backends != {ADDED_IN_0_30}
    )


# --- the tables ------------------------------------------------------------------------------

STRUCTURAL_RULES: tuple[StructuralRule, ...] = _structural_rules()

#: The experts classes, by backend: 0.30's without RDNA3, Humming with 0.29's gemm type.
EXPERTS_CLASSES: dict[str, tuple[ExpertsClass, ...]] = {
    backend: tuple(_humming_class(c) for c in classes) if backend == "HUMMING" else classes
    for backend, classes in base.RULESET.experts_classes.items()
    if backend != ADDED_IN_0_30
}

#: 0.30's priority without RDNA3 (it led the CUDA/ROCm list).
PRIORITY: Priority = dataclasses.replace(
    base.PRIORITY, gpu=tuple(b for b in base.PRIORITY.gpu if b != ADDED_IN_0_30)
)

INTEGRATIONS: IntegrationRules = dataclasses.replace(
    base.RULESET.integrations,
    platform_quantizations=MappingProxyType(
        {
            **base.RULESET.integrations.platform_quantizations,
            "xpu": base.RULESET.integrations.platform_quantizations["xpu"] - {"moe_wna16"},
        }
    ),
    act_order_supported=True,
    ct_rocm_gfx1100_method=CT_RDNA3_METHOD,
    quark_unwraps_single_configs=False,
)

RULESET: Ruleset = dataclasses.replace(
    base.RULESET,
    name=NAME,
    release=RELEASES[NAME],
    backends=tuple(b for b in base.RULESET.backends if b != ADDED_IN_0_30),
    experts_classes=EXPERTS_CLASSES,
    structural_rules=STRUCTURAL_RULES,
    user_backends={k: v for k, v in base.RULESET.user_backends.items() if v != ADDED_IN_0_30},
    kernel_config_moe_backends=MOE_BACKENDS_0_29,
    priority=PRIORITY,
    integrations=INTEGRATIONS,
)
