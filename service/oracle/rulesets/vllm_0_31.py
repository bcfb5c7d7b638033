"""vLLM 0.31.0's WNA16 MoE backend rules: 0.32.0's, with the rows 0.31.0's source differs in.

Read from the installed 0.31.0 wheel beside 0.32.0's and 0.33.0's. The backend enum, the
structural rules of `_backend_incompatibility_reason`, `map_wna16_backend`, every experts
class's support checks (`fused_moe/experts/*.py`) and the modular kernel's
`is_supported_config` equal 0.32.0's, and the integrations' oracle calls (AutoGPTQ, AutoAWQ,
MoeWNA16, compressed-tensors) pass the same arguments. The rows that differ:

- `_get_priority_backends` (`fused_moe/oracle/int_wna16.py`) returns its list as is: there
  is no `prioritize_humming` (`quantization/utils/humming/priority.py` does not exist), so
  MARLIN stays ahead of HUMMING on SM90 as on every other capability;
- KernelConfig's `MoEBackend` literal (`vllm/config/kernel.py`) has
  `flashinfer_moe_ep_mega_cutedsl` and lacks `flashinfer_moe_ep_cutedsl` and `aiter_mega_moe`;
- ParallelConfig's `All2AllBackend` literal (`vllm/config/parallel.py`) lacks `passthrough`.

Differences that change no answer the spec can ask for, so no row carries them:
compressed-tensors looks its MoE projections' schemes up under the fixed names
`<layer>.0.gate_proj` / `.0.up_proj` / `.0.down_proj` (`compressed_tensors_moe.py`; 0.32 uses
the layer's checkpoint names, which the spec does not carry and which default to these), and
has no `_is_mxfp4_w4a8_fp8` branch (not a WNA16 scheme). The compressed-tensors WNA16 method
registers zero points only when the checkpoint is asymmetric or the backend is CPU
(`compressed_tensors_moe_wna16.py`; 0.30 and 0.32 also for RDNA3), which acts after selection:
together with the RDNA3 conversion that skips the N-first to K-first transpose it is the
hazard `RDNA3_CONVERSION_LAYOUT` (service.oracle.hazards), not a different answer.
"""

from __future__ import annotations

import dataclasses

from service.oracle.releases import RELEASES
from service.oracle.rulesets import vllm_0_32 as base
from service.oracle.rulesets.base import Priority, Ruleset
from service.oracle.rulesets.kernel_names import MOE_BACKENDS_0_31

NAME = "vllm-0.31"

#: `_get_priority_backends` without `prioritize_humming`: the plain list on every capability.
PRIORITY: Priority = dataclasses.replace(
    base.RULESET.priority,
    humming_preferred_capabilities=frozenset(),
)
#: `All2AllBackend` without `passthrough`, which 0.32 added.
ALL2ALL_BACKENDS: tuple[str, ...] = tuple(
    name for name in base.RULESET.all2all_backends if name != "passthrough"
)
#: The experts classes that differ from 0.33's, by backend (0.32's: 0.31's classes are its).
EXPERTS_DELTA = base.EXPERTS_DELTA

RULESET: Ruleset = dataclasses.replace(
    base.RULESET,
    name=NAME,
    release=RELEASES[NAME],
    priority=PRIORITY,
    kernel_config_moe_backends=MOE_BACKENDS_0_31,
    all2all_backends=ALL2ALL_BACKENDS,
)
