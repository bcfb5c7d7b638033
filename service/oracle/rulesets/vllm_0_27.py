"""vLLM 0.27.0's WNA16 MoE backend rules: 0.28.0's, with the rows 0.27.0's source differs in.

Read from the installed 0.27.0 wheel beside 0.28.0's (EX is
`vllm/model_executor/layers/fused_moe/experts/`). 0.27.1 differs from 0.27.0 only in
`vllm/_version.py` and one model file, so this ruleset answers for both. The oracle module
(`fused_moe/oracle/int_wna16.py`), the compressed-tensors MoE methods, Marlin's layer checks
and KernelConfig's `MoEBackend` are 0.28's; these rows differ:

- `CPUExpertsInt4._supports_current_device` (EX/cpu_moe.py:436) is `is_cpu()` alone: no
  x86 and AMX requirement, so any CPU runs the CPU backend.
- `TritonExperts` has no `is_supported_config` of its own (EX/triton_moe.py:59), so
  TritonWNA16Experts and Int4EmulationTritonExperts, which inherit it, have no cap on
  the padded expert count.
- `HummingExpertsBase._supports_activation` (EX/fused_humming_moe.py:246) is an explicit
  list without SITU and SWIGLUOAI_UNINTERLEAVE, and the class declares no batch invariance
  (the base class's False), so VLLM_BATCH_INVARIANT=1 refuses every Humming class.
- ROCm's `supported_quantization` (`vllm/platforms/rocm.py:495`) lists bitsandbytes where
  later releases list inc; of the WNA16 method names only inc is missing.

What the spec cannot express (so no row carries it): AutoGPTQ, AutoAWQ and MoeWNA16
allocate w13 as 2 x intermediate whatever the activation (`Q/auto_gptq.py:544`,
`Q/auto_awq.py:595`, `Q/moe_wna16.py:279`; 0.28 sizes it by `w13_num_shards`), which is
after the decision (a hazard says what it does to a non-gated layer);
`MarlinExpertsBase` and `TritonExperts` list their activations explicitly, with the same
members as 0.28's shared set.
"""

from __future__ import annotations

import dataclasses
from types import MappingProxyType

from service.oracle.platform import PlatformProfile
from service.oracle.releases import RELEASES
from service.oracle.rulesets import vllm_0_28 as base
from service.oracle.rulesets.base import ExpertsClass, Ruleset

NAME = "vllm-0.27"

#: `HummingExpertsBase._supports_activation`'s list.
HUMMING_ACTIVATIONS = frozenset(
    {
        "silu",
        "gelu",
        "gelu_tanh",
        "swigluoai",
        "swiglustep",
        "silu_no_mul",
        "gelu_no_mul",
        "gelu_tanh_no_mul",
        "relu2_no_mul",
    }
)


def _any_cpu(platform: PlatformProfile) -> bool:
    return platform.device == "cpu"


(_CPU_0_28,) = base.EXPERTS_CLASSES["CPU"]
CPU_INT4: ExpertsClass = dataclasses.replace(_CPU_0_28, supports_device=_any_cpu)
HUMMING: tuple[ExpertsClass, ...] = tuple(
    dataclasses.replace(cls, activations=HUMMING_ACTIVATIONS, batch_invariant=False)
    for cls in base.EXPERTS_CLASSES["HUMMING"]
)
#: The Triton classes without the padded-expert cap (their only class-specific check).
TRITON_WNA16: ExpertsClass = dataclasses.replace(base.TRITON_WNA16, extra_checks=())
(_EMULATION_0_28,) = base.EXPERTS_CLASSES["EMULATION"]
EMULATION: ExpertsClass = dataclasses.replace(_EMULATION_0_28, extra_checks=())

#: The experts classes that differ from 0.28's, by backend.
EXPERTS_DELTA: dict[str, tuple[ExpertsClass, ...]] = {
    "CPU": (CPU_INT4,),
    "HUMMING": HUMMING,
    "TRITON": (TRITON_WNA16,),
    "EMULATION": (EMULATION,),
}
EXPERTS_CLASSES: dict[str, tuple[ExpertsClass, ...]] = {**base.EXPERTS_CLASSES, **EXPERTS_DELTA}

_QUANTIZATIONS = base.INTEGRATIONS.platform_quantizations
INTEGRATIONS = dataclasses.replace(
    base.INTEGRATIONS,
    platform_quantizations=MappingProxyType(
        {**_QUANTIZATIONS, "rocm": _QUANTIZATIONS["rocm"] - {"inc"}}
    ),
)

RULESET: Ruleset = dataclasses.replace(
    base.RULESET,
    name=NAME,
    release=RELEASES[NAME],
    experts_classes=EXPERTS_CLASSES,
    integrations=INTEGRATIONS,
)
