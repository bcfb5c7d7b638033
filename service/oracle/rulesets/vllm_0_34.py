"""vLLM 0.34.0's WNA16 MoE backend rules: 0.33.0's, with the rows 0.34.0's source differs in.

Read from the installed 0.34.0 wheel beside 0.33.0's and checked against 0.34.0's own answers
over the parity grid. `select_wna16_moe_backend` now runs through a shared oracle base class
(`fused_moe/oracle/base.py`) but keeps its priority lists, `map_wna16_backend`, the order the
experts classes are probed in, the last-rejection rule and its texts. The rows that differ:

- A third activation format. `FusedMoEConfig.activation_format` (`fused_moe/config.py`) is
  batched for DeepEP low-latency, NIXL EP or `--moe-backend batched_triton`,
  `PaddedStandard` for DeepEP v2 (`--all2all-backend deepep_v2` with data and expert
  parallelism), standard otherwise; `is_supported_config` asks whether a class's format is a
  superset of it (`moe_config.format_accepts`). `TritonExperts` (so `TritonWNA16Experts` and
  `Int4EmulationTritonExperts`) and the grouped and indexed Humming experts declare
  `PaddedStandard`; Marlin, FlashInfer TRT-LLM, XPU, CPU, Zentorch and RDNA3 experts stay
  standard, so DeepEP v2 rejects them with "kernel does not support ('padded_standard',)
  activation format".
- `FusedMoEParallelConfig` gains `mori_ep_v2` (False unless the MoRI all2all backend runs
  EPv2), which its parallel-config reason prints; `ParallelConfig`'s `All2AllBackend` gains
  `mori`.
- ZEN_CPU: `ZentorchExpertsInt4` is `ZentorchExpertsWNA16`, which also takes int8 weights
  (`kInt8Static`, run as DA8W8) and MiniMax2 routing (sigmoid scoring with a correction
  bias); `_backend_incompatibility_reason` reads the weight width (`_zen_cpu_num_bits`:
  AutoGPTQ's and AutoAWQ's `weight_bits`, compressed-tensors' `num_bits`) and refuses a
  config it cannot read one from or a width other than 4 and 8, and two reasons are reworded
  ("dynamic-activation path", "the dynamic-quant path requires group-quantized weights").
- Start-up (`service.oracle.startup`): `Platform.validate_environ` refuses
  `VLLM_MARLIN_INPUT_DTYPE` (listed in `envs.removed_environment_variables`: Marlin no longer
  runs 8-bit activations) whatever its value, and `VLLM_USE_V2_MODEL_RUNNER` unless it is
  "1"; `CpuPlatform.check_and_update_config` refuses an x86 CPU without Triton (triton-cpu),
  where 0.33 only warned. With the variable gone, 0.33's W4A8-FP8 refusal in the AutoGPTQ,
  AutoAWQ and compressed-tensors MoE methods (`get_marlin_input_dtype`) is gone too: every
  deployment that sets the variable fails before any method is built.

Unchanged for this decision though their files changed: the integrations' oracle calls (they
only stop passing an activation dtype), KernelConfig's `MoEBackend` literal, and XPU's
construction (it no longer refuses non-Xe2/Xe3 GPUs, after selection).
"""

from __future__ import annotations

import dataclasses

from service.oracle.conversions import ConversionRules
from service.oracle.moe_config import (
    BATCHED_FORMAT,
    PADDED_STANDARD_FORMAT,
    STANDARD_FORMAT,
    MoEConfig,
)
from service.oracle.platform import PlatformProfile
from service.oracle.quant_key import K_INT4_STATIC, K_INT4_STATIC_32, K_INT8_STATIC
from service.oracle.quant_method import AwqConfig, GptqConfig, MoeWNA16Config, WeightArgs
from service.oracle.releases import RELEASES
from service.oracle.rulesets import vllm_0_33 as base
from service.oracle.rulesets.base import ExpertsClass, RuleContext, Ruleset, StructuralRule
from service.oracle.startup import EnvironmentRule, PlatformRule, StartupRules

NAME = "vllm-0.34"

# --- the activation format -------------------------------------------------------------------


def activation_format(moe: MoEConfig) -> str:
    """`FusedMoEConfig.activation_format`: batched for DeepEP low-latency, NIXL EP and the
    `batched_triton` backend name, PaddedStandard for DeepEP v2, standard otherwise."""
    parallel = moe.parallel
    if parallel.use_batched_activation_format or moe.moe_backend == "batched_triton":
        return BATCHED_FORMAT
    if parallel.use_all2all_kernels and parallel.all2all_backend == "deepep_v2":
        return PADDED_STANDARD_FORMAT
    return STANDARD_FORMAT


#: The experts classes that declare PaddedStandard, by name.
PADDED_CLASSES = frozenset(
    {
        "TritonWNA16Experts",
        "Int4EmulationTritonExperts",
        "HummingGroupedExperts",
        "HummingIndexedExperts",
    }
)


def _padded(cls: ExpertsClass) -> ExpertsClass:
    if cls.name in PADDED_CLASSES:
        return dataclasses.replace(cls, activation_format=PADDED_STANDARD_FORMAT)
    return cls


# --- ZEN_CPU ---------------------------------------------------------------------------------

#: `ZentorchExpertsWNA16`: 0.33's class renamed, with int8 weights and MiniMax2 routing.
ZENTORCH_WNA16: ExpertsClass = dataclasses.replace(
    base.ZENTORCH_INT4,
    name="ZentorchExpertsWNA16",
    supports_quant_scheme=frozenset({K_INT4_STATIC, K_INT4_STATIC_32, K_INT8_STATIC}).__contains__,
    routing_methods=(base.ZENTORCH_INT4.routing_methods or frozenset()) | {"MiniMax2"},
)

EXPERTS_CLASSES: dict[str, tuple[ExpertsClass, ...]] = {
    backend: tuple(_padded(cls) for cls in classes)
    for backend, classes in {**base.EXPERTS_CLASSES, "ZEN_CPU": (ZENTORCH_WNA16,)}.items()
}

#: `_ZEN_CPU_NUM_BITS`: the weight widths the Zen CPU op runs (DA8W4, DA8W8).
ZEN_CPU_NUM_BITS = frozenset({4, 8})
#: vLLM's class name of each parsed config, as `type(quant_config).__name__` prints it.
VLLM_CONFIG_CLASSES = {
    GptqConfig: "AutoGPTQConfig",
    AwqConfig: "AutoAWQConfig",
    MoeWNA16Config: "MoeWNA16Config",
    WeightArgs: "QuantizationArgs",
}


def zen_cpu_num_bits(ctx: RuleContext) -> int | None:
    """`_zen_cpu_num_bits`: AutoGPTQ's and AutoAWQ's `weight_bits`, compressed-tensors'
    `num_bits`; None for a config it cannot read one from."""
    config = ctx.quant_config
    if isinstance(config, GptqConfig | AwqConfig):
        return config.bits
    if isinstance(config, WeightArgs):
        return config.num_bits
    return None


def _config_class(ctx: RuleContext) -> str:
    return VLLM_CONFIG_CLASSES.get(type(ctx.quant_config), type(ctx.quant_config).__name__)


def _width_unsupported(ctx: RuleContext) -> bool:
    bits = zen_cpu_num_bits(ctx)
    return bits is not None and bits not in ZEN_CPU_NUM_BITS


#: The ZEN_CPU rules 0.34 inserts, after the act-order ones and before the group-size ones.
ZEN_WIDTH_RULES: tuple[StructuralRule, ...] = (
    StructuralRule(
        frozenset({"ZEN_CPU"}),
        lambda c: zen_cpu_num_bits(c) is None,
        "WEIGHT_WIDTH_UNREADABLE",
        lambda c: f"cannot read a weight width from {_config_class(c)}",
    ),
    StructuralRule(
        frozenset({"ZEN_CPU"}),
        _width_unsupported,
        "WEIGHT_WIDTH",
        lambda c: f"unsupported weight width W{zen_cpu_num_bits(c)}A16",
    ),
)
#: 0.33's ZEN_CPU reasons that 0.34 words differently, by code.
ZEN_REWORDED = {
    "DISABLED_BY_ENV": "VLLM_CPU_INT4_W4A8=0 disables the dynamic-activation path",
    "GROUP_QUANT_REQUIRED": "the dynamic-quant path requires group-quantized weights",
}


def _structural_rules() -> tuple[StructuralRule, ...]:
    rules: list[StructuralRule] = []
    for rule in base.STRUCTURAL_RULES:
        zen = rule.backends == {"ZEN_CPU"}
        if zen and rule.code == "GROUP_QUANT_REQUIRED":
            rules.extend(ZEN_WIDTH_RULES)
        reworded = ZEN_REWORDED.get(rule.code) if zen else None
        rules.append(rule if reworded is None else dataclasses.replace(rule, reason=reworded))
    return tuple(rules)


STRUCTURAL_RULES: tuple[StructuralRule, ...] = _structural_rules()

# --- start-up --------------------------------------------------------------------------------

#: `envs.removed_environment_variables["VLLM_MARLIN_INPUT_DTYPE"]`, the hint vLLM appends.
MARLIN_INPUT_DTYPE_HINT = (
    "Marlin no longer supports 8-bit activations. Use `--quantization humming` and set the "
    'activation dtype with VLLM_HUMMING_INPUT_QUANT_CONFIG, e.g. \'{"dtype":"int8"}\'.'
)


def _x86_without_triton(platform: PlatformProfile) -> bool:
    return platform.device == "cpu" and platform.x86 and not platform.has_package("triton")


STARTUP = StartupRules(
    environment=(
        EnvironmentRule(
            "VLLM_MARLIN_INPUT_DTYPE",
            lambda value: True,
            lambda value: f"VLLM_MARLIN_INPUT_DTYPE has been removed. {MARLIN_INPUT_DTYPE_HINT}",
        ),
        EnvironmentRule(
            "VLLM_USE_V2_MODEL_RUNNER",
            lambda value: value != "1",
            lambda value: (
                f"VLLM_USE_V2_MODEL_RUNNER={value} is no longer supported: Model Runner V1 "
                "has been removed. Unset this variable."
            ),
        ),
    ),
    platform=(
        PlatformRule(
            _x86_without_triton,
            "RuntimeError",
            "vLLM on x86 CPUs requires Triton (triton-cpu).",
        ),
    ),
)

# --- the parallel config ---------------------------------------------------------------------


def _with_after(names: tuple[str, ...], anchor: str, added: str) -> tuple[str, ...]:
    index = names.index(anchor) + 1
    return (*names[:index], added, *names[index:])


#: `All2AllBackend`: 0.33's with `mori` (the ROCm MoRI backend) after `moonep`.
ALL2ALL_BACKENDS: tuple[str, ...] = _with_after(base.ALL2ALL_BACKENDS, "moonep", "mori")

RULESET: Ruleset = dataclasses.replace(
    base.RULESET,
    name=NAME,
    release=RELEASES[NAME],
    experts_classes=EXPERTS_CLASSES,
    structural_rules=STRUCTURAL_RULES,
    activation_format=activation_format,
    all2all_backends=ALL2ALL_BACKENDS,
    parallel_config_extra=(("mori_ep_v2", False),),
    startup=STARTUP,
    # Marlin's int8 and fp8 activation branches went with VLLM_MARLIN_INPUT_DTYPE.
    conversions=ConversionRules(marlin_8bit_activations=False),
)
