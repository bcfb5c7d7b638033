"""vLLM 0.30.0's WNA16 MoE backend rules: 0.31.0's, with the rows 0.30.0's source differs in.

Read from the installed 0.30.0 wheel beside 0.31.0's. The rows that differ:

- there is no ZEN_CPU backend (`fused_moe/oracle/int_wna16.py`): the enum lacks it, the CPU
  priority is `[CPU]`, `_backend_incompatibility_reason` has no ZEN_CPU block (so none of its
  reasons) and `fused_moe/experts/zentorch_moe.py` does not exist; nothing on the decision
  path reads `VLLM_CPU_INT4_W4A8`, so a spec that sets it is refused under this ruleset;
- compressed-tensors' `WNA16_ZP_SUPPORTED_TYPES_MAP`
  (`quantization/compressed_tensors/schemes/compressed_tensors_wNa16.py`) maps only 4 and 8
  bits, so an asymmetric 2/3/5/6/7-bit checkpoint makes `CompressedTensorsWNA16MoEMethod`'s
  constructor raise `KeyError(bits)` before it calls the oracle;
- `ParallelConfig` (`vllm/config/parallel.py:527`) refuses expert-parallel load balancing
  on anything but CUDA and ROCm (0.31 added XPU): pydantic's `ValidationError` while the
  engine config is built.
- AMD Quark has no int4 weight-only MoE method (`quantization/quark/quark_moe.py`:
  `QuarkW4A16Int4MoEMethod` and `QuarkConfig._is_w4a16_int4` arrived in 0.31), so an int4
  weight-only routed-experts layer gets `get_moe_method_target`'s
  RuntimeError("Unsupported FusedMoe scheme") and never reaches the oracle.
- `ParallelConfig`'s `All2AllBackend` literal lacks `moonep` (0.31 added it), as 0.27's to
  0.29's do; a spec naming it is refused under this ruleset and the older ones.

One conversion differs (`ConversionRules`, read by the writers, not the oracle):
`_process_weights_xpu` (`fused_moe/oracle/int_wna16.py`) transposes dimensions 1 and 2 of
the weights and scales it is handed, where 0.31 hands them over as they are; the older
rulesets inherit it (their source has the same function).

Listed for 0.30 by the release sheet but no row here, since they change no answer: XPU's
`supported_quantization` has `moe_wna16` in 0.30 as in 0.31 (0.30 is where it arrived), and
HUMMING's int8-dynamic activation key (added in 0.31) is never asked for, since the WNA16
oracle passes no activation key.

Differences the spec cannot express, so no row carries them: the modular kernel's
`is_supported_config` has no hash-routing rule (the spec has no hash routing); the
compressed-tensors WNA16 method allocates its weights K-first for most backends and
allocates no expert biases (after selection: the bias is the hazard
`CT_EXPERT_BIAS_NOT_LOADED` in service.oracle.hazards, the layout only moves bytes that the
converters move back).
"""

from __future__ import annotations

import dataclasses

from service.oracle.quant_method import IntegrationRules
from service.oracle.releases import RELEASES
from service.oracle.rulesets import vllm_0_31 as base
from service.oracle.rulesets.base import ExpertsClass, Priority, Ruleset, StructuralRule

NAME = "vllm-0.30"

#: The backend 0.31 added, with its experts class, rules and CPU priority slot.
ABSENT_BACKENDS = frozenset({"ZEN_CPU"})
#: Flags 0.31 started reading for the decision (ZEN_CPU's switch).
UNREAD_ENV_FLAGS = frozenset({"VLLM_CPU_INT4_W4A8"})

BACKENDS: tuple[str, ...] = tuple(b for b in base.RULESET.backends if b not in ABSENT_BACKENDS)
EXPERTS_CLASSES: dict[str, tuple[ExpertsClass, ...]] = {
    backend: classes
    for backend, classes in base.RULESET.experts_classes.items()
    if backend not in ABSENT_BACKENDS
}
#: 0.31's rules with the absent backends taken out (a rule left with none is gone).
STRUCTURAL_RULES: tuple[StructuralRule, ...] = tuple(
    dataclasses.replace(rule, backends=rule.backends - ABSENT_BACKENDS)
    for rule in base.RULESET.structural_rules
    if rule.backends - ABSENT_BACKENDS
)
PRIORITY: Priority = dataclasses.replace(
    base.PRIORITY, cpu=tuple(b for b in base.PRIORITY.cpu if b not in ABSENT_BACKENDS)
)
#: compressed-tensors' zero-point types exist for 4 and 8 bits only; ParallelConfig balances
#: experts on CUDA and ROCm only; Quark has no int4 weight-only MoE method.
INTEGRATIONS: IntegrationRules = dataclasses.replace(
    base.RULESET.integrations,
    ct_zero_point_bits=frozenset({4, 8}),
    eplb_devices=("cuda", "rocm"),
    quark_w4a16_moe=False,
)
#: `All2AllBackend` without `moonep`, which 0.31 added (0.27 to 0.30 have the same literal).
ALL2ALL_BACKENDS: tuple[str, ...] = tuple(
    name for name in base.RULESET.all2all_backends if name != "moonep"
)
#: `_process_weights_xpu` transposes whatever it is handed (`fused_moe/oracle/int_wna16.py`).
CONVERSIONS = dataclasses.replace(base.RULESET.conversions, xpu_transposes=True)
#: The experts classes that differ from 0.33's, by backend (as 0.31's; ZEN_CPU is absent).
EXPERTS_DELTA = base.EXPERTS_DELTA

RULESET: Ruleset = dataclasses.replace(
    base.RULESET,
    name=NAME,
    release=RELEASES[NAME],
    backends=BACKENDS,
    experts_classes=EXPERTS_CLASSES,
    structural_rules=STRUCTURAL_RULES,
    priority=PRIORITY,
    env_flags=base.RULESET.env_flags - UNREAD_ENV_FLAGS,
    integrations=INTEGRATIONS,
    conversions=CONVERSIONS,
    all2all_backends=ALL2ALL_BACKENDS,
)
