"""vLLM 0.28.0's WNA16 MoE backend rules: 0.29.0's, with the rows 0.28.0's source differs in.

Read from the installed 0.28.0 wheel beside 0.29.0's (paths inside the wheel; EX is
`vllm/model_executor/layers/fused_moe/experts/`, Q is
`vllm/model_executor/layers/quantization/`, CTM is `Q/compressed_tensors/
compressed_tensors_moe/`). The oracle module (`fused_moe/oracle/int_wna16.py`: enum,
priority, every structural rule and its string, the select function) decides as 0.29's
does; these rows differ:

- Humming takes only the WNA16 keys it lists (`HummingExpertsBase._supports_quant_scheme`,
  EX/fused_humming_moe.py:229): `(kInt4Static, None)` and `(kInt8Static, None)`. 0.29 added
  the fall-back that accepts any unsigned 2..8-bit key with channel or (1, g) groups, so
  here group-32 int4 (compressed-tensors, MoeWNA16), asymmetric and other-width keys are
  refused with "kernel does not support quantization scheme ...".
- `TritonWNA16Experts` (EX/triton_moe.py:578) takes kInt4Static, kInt8Static and
  kInt4Static32 only (no asymmetric keys), and its activations lack SWIGLUOAI_UNINTERLEAVE.
- compressed-tensors' `CompressedTensorsWNA16MoEMethod.__init__` (CTM/
  compressed_tensors_moe_wna16.py:60-131) knows int4 and int8 only: 8-bit asserts
  `group_size == -1` (the scheme's own value, so a per-channel scheme without a group size
  fails it), other widths raise "CompressedTensorsWNA16MoEMethod only supports int4 and
  int8 now.", both before the oracle; and its non-Marlin branch also asserts "Only
  symmetric quantization is supported for MoE" after the oracle chose.
- `MoeWNA16Method.__init__` (Q/moe_wna16.py:224) asserts `group_size == -1` for 8-bit.
- compressed-tensors' format/bits refusal (CTM/compressed_tensors_moe.py:82) hands
  `ValueError` four pieces, so its text is the tuple of them.
- Quark's `_find_matched_config` (Q/quark/quark.py:612) walks `layer_quant_config`
  unguarded (a config without one raises AttributeError) and asks `layer_type_quant_config`
  only when no pattern matched (a missing one raises TypeError there); 0.29 reads the type
  table first and takes a missing `layer_quant_config` as empty.
- KernelConfig's `MoEBackend` (`vllm/config/kernel.py:122`) lacks b12x,
  flashinfer_moe_ep_mega_deep_gemm and flashinfer_moe_ep_mega_cutedsl.

What the spec cannot express (so no row carries it): `_humming_wna16_weight_schema` has no
compressed-tensors branch, so a compressed-tensors layer that selects HUMMING raises
TypeError while its weights are converted, after the decision (a hazard says so); the
TRITON conversion passes zero points through un-repacked (a conversion difference, no
selection effect: asymmetric schemes cannot reach TRITON here); compressed-tensors'
`is_transposed` is `backend != FLASHINFER_TRTLLM` (a layout difference).
"""

from __future__ import annotations

import dataclasses

from service.oracle.quant_key import K_INT4_STATIC, K_INT4_STATIC_32, K_INT8_STATIC
from service.oracle.releases import RELEASES
from service.oracle.rulesets import vllm_0_29 as base
from service.oracle.rulesets.base import ExpertsClass, Ruleset
from service.oracle.rulesets.kernel_names import MOE_BACKENDS_0_28

NAME = "vllm-0.28"

#: The WNA16 weight keys Humming's list has (each with no activation key).
HUMMING_WNA16_KEYS = frozenset({K_INT4_STATIC, K_INT8_STATIC})
#: `TritonWNA16Experts`' SUPPORTED_W.
TRITON_WNA16_KEYS = frozenset({K_INT4_STATIC, K_INT8_STATIC, K_INT4_STATIC_32})
#: The activation 0.29 added to `TritonWNA16Experts`.
ADDED_IN_0_29_TRITON_ACTIVATION = "swigluoai_uninterleave"

HUMMING: tuple[ExpertsClass, ...] = tuple(
    dataclasses.replace(cls, supports_quant_scheme=HUMMING_WNA16_KEYS.__contains__)
    for cls in base.EXPERTS_CLASSES["HUMMING"]
)
(_TRITON_0_29,) = base.EXPERTS_CLASSES["TRITON"]
TRITON_WNA16: ExpertsClass = dataclasses.replace(
    _TRITON_0_29,
    supports_quant_scheme=TRITON_WNA16_KEYS.__contains__,
    activations=_TRITON_0_29.activations - {ADDED_IN_0_29_TRITON_ACTIVATION},
)

#: The experts classes that differ from 0.29's, by backend.
EXPERTS_DELTA: dict[str, tuple[ExpertsClass, ...]] = {
    "HUMMING": HUMMING,
    "TRITON": (TRITON_WNA16,),
}
EXPERTS_CLASSES: dict[str, tuple[ExpertsClass, ...]] = {
    **base.RULESET.experts_classes,
    **EXPERTS_DELTA,
}

INTEGRATIONS = dataclasses.replace(
    base.RULESET.integrations,
    int8_channelwise_only=True,
    ct_moe_bits=frozenset({4, 8}),
    ct_non_marlin_symmetric_only=True,
    ct_format_error_in_pieces=True,
    quark_legacy_config_lookup=True,
)

RULESET: Ruleset = dataclasses.replace(
    base.RULESET,
    name=NAME,
    release=RELEASES[NAME],
    experts_classes=EXPERTS_CLASSES,
    kernel_config_moe_backends=MOE_BACKENDS_0_28,
    integrations=INTEGRATIONS,
)
