"""Known vLLM 0.33 misbehaviours on a chosen path, found by reading its source.

The decision stays what vLLM does (users need the truth about their fleet); a hazard says
what will go wrong after selection, so the user can pick another backend or checkpoint.
"""

from __future__ import annotations

from service.oracle.decision import Hazard
from service.oracle.moe_config import MoEConfig
from service.oracle.quant_method import AwqConfig, GptqConfig, MoeWNA16Config, OracleCall
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


def hazards_for(
    spec: DeploymentSpec, plan: OracleCall, backend: str, moe: MoEConfig
) -> tuple[Hazard, ...]:
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
        if backend == "XPU":
            found.append(
                Hazard(
                    "MOE_WNA16_XPU_LAYOUT",
                    "The XPU conversion transposes MoeWNA16's already N-first uint8 weights "
                    "and drops zero points: outputs are wrong (or it asserts with zero points).",
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
    if isinstance(config, AwqConfig) and backend == "XPU":
        found.append(
            Hazard(
                "AWQ_XPU_LAYOUT",
                "The XPU conversion applies the GPTQ K-first transpose to AWQ's N-packed "
                "weights and drops zero points: outputs are wrong.",
            )
        )
    if backend == "EMULATION" and spec.layer.has_bias:
        found.append(
            Hazard(
                "EMULATION_DROPS_BIAS",
                "EMULATION discards expert biases during conversion.",
            )
        )
    return tuple(found)
