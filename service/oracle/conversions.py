"""How a vLLM release lays converted weights out, where releases differ, as data.

`convert_to_wna16_moe_kernel_format` writes different bytes for the same checkpoint in some
releases; the writers (`service.formats.writers`) read these facts from the target's
ruleset (`Ruleset.conversions`) so that a conversion for a release writes that release's
bytes. The defaults are the newest release's. Act-order on Marlin is not repeated here: a
release converts it exactly when it accepts act-order at all
(`IntegrationRules.act_order_supported`).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ConversionRules:
    """The conversion behaviour that differs between vLLM releases."""

    #: Whether `_process_weights_xpu` transposes dimensions 1 and 2 of the weights and
    #: scales it is handed, whatever the integration (0.30 and older). GPTQ and
    #: compressed-tensors then handed it K-first tensors (0.31 moved that transpose into
    #: the integrations), so their bytes are the same in every release; AutoAWQ's K-first
    #: words and MoeWNA16's N-first bytes come out transposed.
    xpu_transposes: bool = False
    #: Whether Marlin converts for 8-bit activations (`VLLM_MARLIN_INPUT_DTYPE` int8 or fp8:
    #: int16 relative scales with a global scale, or fp8-remapped codes with scales x512).
    #: 0.34 removed both paths with the variable; 0.33 and older have them.
    marlin_8bit_activations: bool = False
