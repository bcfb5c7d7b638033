"""Known vLLM misbehaviours on a chosen path, found by reading each release's source.

The decision stays what vLLM does (users need the truth about their fleet); a hazard says
what will go wrong after selection, so the user can pick another backend or checkpoint.
The hazards of `hazards_for`'s body were read from 0.33.0's source and are given under every
ruleset; those known to hold for some releases only are rows of `RELEASE_HAZARDS`, each
naming the rulesets it applies to.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from service.oracle.decision import Hazard
from service.oracle.moe_config import MoEConfig
from service.oracle.quant_method import (
    CT_RDNA3_METHOD,
    AwqConfig,
    GptqConfig,
    MoeWNA16Config,
    OracleCall,
    QuarkConfig,
    WeightArgs,
)
from service.oracle.rulesets import RULESETS
from service.oracle.spec import DeploymentSpec


def _moe_wna16_group_hazard(config: MoeWNA16Config, moe: MoEConfig) -> Hazard | None:
    """MoeWNA16's create_weights halves the group size until it divides both dimensions."""
    group = config.group_size
    if group == -1:
        return Hazard(
            "MOE_WNA16_CHANNELWISE_CRASH",
            "MoeWNA16Method.create_weights cannot handle group_size -1 (channelwise): it "
            "computes negative scale shapes and crashes at load (vLLM issue #52715).",
        )
    while group >= 32 and (moe.intermediate_size_per_partition % group or moe.hidden_dim % group):
        group //= 2
    if group < 32:
        return Hazard(
            "MOE_WNA16_GROUP_SIZE_ASSERT",
            f"MoeWNA16Method.create_weights asserts at load: no group size >= 32 dividing "
            f"both hidden ({moe.hidden_dim}) and intermediate per partition "
            f"({moe.intermediate_size_per_partition}) is reachable by halving "
            f"{config.group_size}.",
        )
    return None


def _quark_group_hazard(config: QuarkConfig, moe: MoEConfig) -> Hazard | None:
    """QuarkW4A16Int4MoEMethod.create_weights (read from the source) halves the group size
    while it does not divide both dimensions, asserting after each halving that it stays
    >= 32 (a group size that divides both is kept as it is, even below 32)."""
    group = config.weight_group_size
    hidden, inter = moe.hidden_dim, moe.intermediate_size_per_partition
    while inter % group or hidden % group:
        group //= 2
        if group < 32:
            return Hazard(
                "QUARK_GROUP_SIZE_ASSERT",
                "QuarkW4A16Int4MoEMethod.create_weights asserts at load: halving the group "
                f"size {config.weight_group_size} reaches none >= 32 dividing both hidden "
                f"({hidden}) and intermediate per partition ({inter}).",
            )
    return None


#: Quark's int4 weight-only layer after selection, by backend. HUMMING's and CPU's refusals
#: and EMULATION's misread were run (vLLM's own loader and conversion on CPU: the Quark
#: cases of tests/formats/exactness_cases.py); FlashInfer's misread is read from the source
#: only (its preparation needs a Blackwell GPU).
QUARK_BACKEND_HAZARDS: dict[str, Hazard] = {
    "HUMMING": Hazard(
        "QUARK_HUMMING_SCHEMA_TYPE_ERROR",
        "vLLM's Humming weight conversion knows AutoAWQ, AutoGPTQ and compressed-tensors "
        "checkpoints only: converting this Quark layer raises TypeError('Humming WNA16 "
        "checkpoint schema requires AutoAWQConfig, AutoGPTQConfig or QuantizationArgs, got "
        "QuarkConfig.') and the model fails to load (--moe-backend triton avoids it).",
    ),
    "CPU": Hazard(
        "QUARK_CPU_TYPE_ERROR",
        "vLLM's CPU weight conversion knows AutoAWQ, AutoGPTQ and compressed-tensors "
        "checkpoints only: converting this Quark layer raises TypeError('CPU WNA16 MoE "
        "backend requires AutoAWQConfig, AutoGPTQConfig or QuantizationArgs, got "
        "QuarkConfig.') and the model fails to load.",
    ),
    "FLASHINFER_TRTLLM": Hazard(
        "QUARK_FLASHINFER_LAYOUT",
        "FlashInfer's MxInt4 preparation converts offset-8 (uint4b8) nibbles to signed int4 "
        "only for int32 weights, but Quark's loader hands it uint8 bytes already offset by "
        "8: every weight is off by 8 and outputs are wrong; it also asserts bfloat16 "
        "scales, so a float16 model fails at load.",
    ),
    "EMULATION": Hazard(
        "QUARK_EMULATION_MISREAD",
        "EMULATION unpacks the weights it is handed as GPTQ int32 words (eight codes each), "
        "but Quark's loader hands it uint8 bytes (two codes each): a symmetric layer's "
        "dequantized w13 comes out with four times the hidden size and fails at its first "
        "forward, and an asymmetric layer's zero points fail to reshape, so loading fails "
        "(RuntimeError).",
    ),
}


def _quark_hazards(
    spec: DeploymentSpec, config: QuarkConfig, backend: str, moe: MoEConfig
) -> list[Hazard]:
    """What goes wrong for Quark's int4 weight-only layer after selection: the backend's
    conversion, the group-size halving, and what its weights never hold (read from the
    source: create_weights sizes w13 for a gated layer and creates no expert biases)."""
    found = [QUARK_BACKEND_HAZARDS[backend]] if backend in QUARK_BACKEND_HAZARDS else []
    group_hazard = _quark_group_hazard(config, moe)
    if group_hazard is not None:
        found.append(group_hazard)
    if not spec.layer.is_gated:
        found.append(
            Hazard(
                "QUARK_NON_GATED_W13_DOUBLED",
                "QuarkW4A16Int4MoEMethod allocates w13 with twice the intermediate size "
                "whatever the activation: a non-gated layer loads one projection there, the "
                "other half stays uninitialised and the kernels run with a doubled "
                "intermediate size.",
            )
        )
    if spec.layer.has_bias:
        found.append(
            Hazard(
                "QUARK_EXPERT_BIAS_NOT_LOADED",
                "QuarkW4A16Int4MoEMethod creates no expert biases (it tells the oracle "
                "may_have_bias=False whatever the layer has): the checkpoint's biases have "
                "no parameter to load into and the kernels run without them.",
            )
        )
    return found


@dataclass(frozen=True, slots=True)
class ReleaseHazard:
    """A misbehaviour of some releases only: the rulesets it applies to and when."""

    code: str
    rulesets: frozenset[str]
    applies: Callable[[DeploymentSpec, OracleCall, str], bool]
    message: str

    def hazard(self) -> Hazard:
        return Hazard(self.code, self.message)


def _ct_on(backend: str) -> Callable[[DeploymentSpec, OracleCall, str], bool]:
    def applies(spec: DeploymentSpec, plan: OracleCall, chosen: str) -> bool:
        return isinstance(plan.quant_config, WeightArgs) and chosen == backend

    return applies


def _ct_with_expert_bias(spec: DeploymentSpec, plan: OracleCall, chosen: str) -> bool:
    return isinstance(plan.quant_config, WeightArgs) and spec.layer.has_bias


def _ct_rdna3_method(spec: DeploymentSpec, plan: OracleCall, chosen: str) -> bool:
    return plan.moe_method == CT_RDNA3_METHOD


def _moe_wna16_with_gptq_act_order(spec: DeploymentSpec, plan: OracleCall, chosen: str) -> bool:
    config = spec.hf_quantization_config
    return (
        isinstance(plan.quant_config, MoeWNA16Config)
        and plan.quant_config.linear_quant_method == "gptq"
        and config.get("desc_act") is True
        and config.get("group_size") != -1
    )


def _non_gated_with_doubled_w13(spec: DeploymentSpec, plan: OracleCall, chosen: str) -> bool:
    integrations = (GptqConfig, AwqConfig, MoeWNA16Config)
    return isinstance(plan.quant_config, integrations) and not spec.layer.is_gated


def _ct_dynamic_act_order(spec: DeploymentSpec, plan: OracleCall, chosen: str) -> bool:
    return isinstance(plan.quant_config, WeightArgs) and plan.quant_config.actorder == "dynamic"


def _moe_wna16_on(backend: str) -> Callable[[DeploymentSpec, OracleCall, str], bool]:
    def applies(spec: DeploymentSpec, plan: OracleCall, chosen: str) -> bool:
        return isinstance(plan.quant_config, MoeWNA16Config) and chosen == backend

    return applies


#: The rulesets whose XPU conversion transposes what it is handed (`ConversionRules`).
XPU_TRANSPOSING_RULESETS = frozenset(
    name for name, rules in RULESETS.items() if rules.conversions.xpu_transposes
)

RELEASE_HAZARDS: tuple[ReleaseHazard, ...] = (
    ReleaseHazard(
        "MOE_WNA16_XPU_LAYOUT",
        XPU_TRANSPOSING_RULESETS,
        _moe_wna16_on("XPU"),
        "vLLM 0.30's (and older releases') XPU conversion transposes MoeWNA16's weights and "
        "scales, which are already in the kernel's N-first layout, so the kernel reads them "
        "on the wrong axes: outputs are wrong (0.31 hands them over as they are).",
    ),
    ReleaseHazard(
        "CT_HUMMING_SCHEMA_TYPE_ERROR",
        frozenset({"vllm-0.27", "vllm-0.28"}),
        _ct_on("HUMMING"),
        "vLLM 0.28 and older have no compressed-tensors branch in the Humming weight "
        "conversion (`_humming_wna16_weight_schema`): converting this layer's weights raises "
        "TypeError('Humming WNA16 checkpoint schema requires AutoAWQConfig or AutoGPTQConfig, "
        "got QuantizationArgs.') and the model fails to load (0.29 converts it).",
    ),
    ReleaseHazard(
        "NON_GATED_W13_DOUBLED",
        frozenset({"vllm-0.27"}),
        _non_gated_with_doubled_w13,
        "vLLM 0.27's AutoGPTQ, AutoAWQ and MoeWNA16 MoE methods allocate w13 with twice the "
        "intermediate size whatever the activation: a non-gated layer's checkpoint has one "
        "projection there, so half of w13 is never loaded (uninitialised memory) and the "
        "kernels run with a doubled intermediate size (0.28 sizes w13 by the activation).",
    ),
    ReleaseHazard(
        "RDNA3_CONVERSION_LAYOUT",
        frozenset({"vllm-0.31"}),
        _ct_on("RDNA3"),
        "vLLM 0.31's RDNA3 conversion takes compressed-tensors' N-first weights and scales "
        "for the kernel's K-first layout (it transposes neither), so the nibble shuffle and "
        "the synthesised zero points are computed on the wrong axes; and the method registers "
        "zero points only for asymmetric or CPU checkpoints, so the synthesised ones are "
        "dropped and the kernel gets none. Outputs are wrong (0.30 and 0.32+ convert it "
        "correctly).",
    ),
    ReleaseHazard(
        "CT_EXPERT_BIAS_NOT_LOADED",
        frozenset({"vllm-0.27", "vllm-0.28", "vllm-0.29", "vllm-0.30"}),
        _ct_with_expert_bias,
        "vLLM 0.30's (and older releases') compressed-tensors WNA16 MoE method allocates no "
        "expert biases: the checkpoint's biases have no parameter to load into and the "
        "kernels run without them (0.31 added them).",
    ),
    ReleaseHazard(
        "CT_RDNA3_METHOD_LOAD_FAILS",
        frozenset({"vllm-0.27", "vllm-0.28", "vllm-0.29"}),
        _ct_rdna3_method,
        f"On gfx1100 vLLM builds {CT_RDNA3_METHOD} for this layer (the backend above is "
        "the oracle's choice, which it only logs: the method runs its own RDNA3 HIP kernel). "
        "The method inherits create_weights, which pops 'intermediate_size_full', but the "
        "layer passes that only to the methods it names, and not to this one: loading the "
        "model raises KeyError('intermediate_size_full').",
    ),
    ReleaseHazard(
        "MOE_WNA16_DROPS_ACT_ORDER",
        frozenset({"vllm-0.27", "vllm-0.28", "vllm-0.29"}),
        _moe_wna16_with_gptq_act_order,
        "The checkpoint has GPTQ activation ordering (desc_act), but MoeWNA16's weight loader "
        "skips g_idx and its kernels read the groups in column order: outputs are wrong "
        "(vLLM 0.30 refuses such checkpoints).",
    ),
    ReleaseHazard(
        "CT_DYNAMIC_ACT_ORDER_DROPPED",
        frozenset({"vllm-0.27", "vllm-0.28", "vllm-0.29"}),
        _ct_dynamic_act_order,
        "compressed-tensors' actorder 'dynamic' is its alias of 'group' (columns must be "
        "reordered by g_idx at runtime), but vLLM compares the stored string with 'group': "
        "the Marlin conversion resets g_idx to empty and the other kernels never read it, "
        "so outputs are wrong (vLLM 0.30 refuses such checkpoints).",
    ),
)


def hazards_for(
    spec: DeploymentSpec, plan: OracleCall, backend: str, moe: MoEConfig, ruleset: str
) -> tuple[Hazard, ...]:
    """The hazards of the path `ruleset`'s release takes with `backend`."""
    found: list[Hazard] = []
    config = plan.quant_config
    if isinstance(config, GptqConfig) and backend == "EMULATION":
        found.append(
            Hazard(
                "GPTQ_EMULATION_ZERO_POINT",
                "AutoGPTQ on EMULATION dequantizes with the stored GPTQ v1 zero point as is "
                "(zero point minus one, 7 for symmetric int4) instead of 8: every weight is "
                "off by one quantization step.",
            )
        )
    if isinstance(config, MoeWNA16Config):
        if backend == "CPU":
            found.append(
                Hazard(
                    "MOE_WNA16_CPU_CONVERSION",
                    "The CPU backend cannot convert the MoeWNA16 layout: weight loading "
                    "raises TypeError after selection.",
                )
            )
        if backend == "FLASHINFER_TRTLLM":
            found.append(
                Hazard(
                    "MOE_WNA16_FLASHINFER_LAYOUT",
                    "FlashInfer's MxInt4 preparation converts uint4b8 to signed int4 only for "
                    "int32 input, but MoeWNA16 weights are uint8; scales must be bfloat16.",
                )
            )
        group_hazard = _moe_wna16_group_hazard(config, moe)
        if group_hazard is not None:
            found.append(group_hazard)
    if isinstance(config, QuarkConfig):
        found.extend(_quark_hazards(spec, config, backend, moe))
    if isinstance(config, AwqConfig) and backend == "XPU":
        found.append(
            Hazard(
                "AWQ_XPU_LAYOUT",
                "The XPU conversion hands AutoAWQ's K-first int32 words (eight N channels "
                "each, in AWQ's interleaved order) to a kernel that reads N-first bytes "
                "packed along K (0.30 and older transpose the words first, which is no "
                "closer), and it writes no zero points: outputs are wrong.",
            )
        )
    if backend == "EMULATION" and spec.layer.has_bias:
        found.append(
            Hazard(
                "EMULATION_DROPS_BIAS",
                "EMULATION discards expert biases during conversion.",
            )
        )
    found.extend(
        row.hazard()
        for row in RELEASE_HAZARDS
        if ruleset in row.rulesets and row.applies(spec, plan, backend)
    )
    return tuple(found)
