"""vLLM 0.32.0's WNA16 MoE backend rules: 0.33.0's, with the few rows 0.32.0's source differs in.

Read from the installed 0.32.0 wheel beside 0.33.0's. The oracle module
(`fused_moe/oracle/int_wna16.py`), `prioritize_humming`, the integrations' oracle calls and
every structural rule are byte-identical, so this ruleset is 0.33's with these rows replaced:

- `CPUExpertsInt4._supports_activation` accepts SILU only (0.33 added GELU_TANH);
- `TrtLlmMxint4ExpertsMonolithic` also accepts `RoutingMethodType.Simulated`, and float32
  router logits with it as with DeepSeekV3 (0.33: DeepSeekV3 only);
- KernelConfig's `MoEBackend` literal lacks `aiter_triton_mxfp4_mxfp4`.

Differences of 0.32.0 that the spec cannot express, so no row here carries them: the
modular kernel has no `require_decomposed_backend` rejection of monolithic classes (the
oracle models no layer that needs a decomposed backend), its hash-routing rule has no
per-class escape (no WNA16 class takes the escape in 0.33 either), and `resolve_quant_method`
refuses to requantize a checkpoint-quantized MoE layer online (the oracle models no online
quantization on top of a checkpoint's).
"""

from __future__ import annotations

import dataclasses

from service.oracle.releases import RELEASES
from service.oracle.rulesets import vllm_0_33 as base
from service.oracle.rulesets.base import ExpertsClass, Ruleset
from service.oracle.rulesets.kernel_names import MOE_BACKENDS_0_32

NAME = "vllm-0.32"


def _trtllm_router_logits(dtype: str, routing: str) -> bool:
    """float32 router logits only with DeepSeekV3 or Simulated routing; others accept any."""
    return routing in ("DeepSeekV3", "Simulated") if dtype == "float32" else True


#: `CPUExpertsInt4`: `activation == MoEActivation.SILU`.
CPU_INT4: ExpertsClass = dataclasses.replace(base.CPU_INT4, activations=frozenset({"silu"}))
#: `TrtLlmMxint4ExpertsMonolithic`: 0.33's routing methods plus Simulated.
TRTLLM_MXINT4: ExpertsClass = dataclasses.replace(
    base.TRTLLM_MXINT4,
    routing_methods=(base.TRTLLM_MXINT4.routing_methods or frozenset()) | {"Simulated"},
    supports_router_logits=_trtllm_router_logits,
)

#: The experts classes that differ from 0.33's, by backend.
EXPERTS_DELTA: dict[str, tuple[ExpertsClass, ...]] = {
    "CPU": (CPU_INT4,),
    "FLASHINFER_TRTLLM": (TRTLLM_MXINT4,),
}

RULESET: Ruleset = dataclasses.replace(
    base.RULESET,
    name=NAME,
    release=RELEASES[NAME],
    experts_classes={**base.EXPERTS_CLASSES, **EXPERTS_DELTA},
    kernel_config_moe_backends=MOE_BACKENDS_0_32,
)
