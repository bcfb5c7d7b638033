"""Where vLLM 0.33's WNA16 MoE methods keep each converted tensor: data, one row per fact.

Each method's `process_weights_after_loading` calls ``convert_to_wna16_moe_kernel_format``
and stores its ten outputs (`CONVERSION_SLOTS`) in layer parameters of its own naming;
the kernel it then builds reads them there. A converted checkpoint's tensor carries its slot
(config.json), so loading it is: put each slot where the layer's method would have put it.
"""

from __future__ import annotations

from collections.abc import Mapping

from moe_control_vllm.checkpoint.manifest import CONVERSION_SLOTS

__all__ = [
    "ALIASES",
    "BACKEND_ATTRIBUTES",
    "FORCED_BACKEND",
    "PARAMETERS",
    "PLACEHOLDERS",
    "parameter_names",
]

_SAME = {slot: slot for slot in CONVERSION_SLOTS}

#: MoE method class -> slot -> the layer parameter its process_weights_after_loading
#: stores that output in.
PARAMETERS: Mapping[str, Mapping[str, str]] = {
    "AutoGPTQMoEMethod": _SAME,
    "AutoAWQMoEMethod": _SAME,
    "MoeWNA16Method": _SAME,
    "CompressedTensorsWNA16MoEMethod": {
        **_SAME,
        "w13_qweight": "w13_weight_packed",
        "w2_qweight": "w2_weight_packed",
        "w13_scales": "w13_weight_scale",
        "w2_scales": "w2_weight_scale",
        "w13_qzeros": "w13_weight_zero_point",
        "w2_qzeros": "w2_weight_zero_point",
    },
}

#: The modular kernel reads ``w13_weight`` / ``w2_weight``; every method above points these
#: attributes at its converted weight parameters: alias -> slot.
ALIASES: Mapping[str, str] = {"w13_weight": "w13_qweight", "w2_weight": "w2_qweight"}

#: Converted backend -> the ``--moe-backend`` value that makes vLLM's oracle select it
#: (and check that this platform can run it). BATCHED_MARLIN has no value of its own (vLLM
#: picks it only for batched activations) and HUMMING converts in place on the GPU.
FORCED_BACKEND: Mapping[str, str] = {
    "TRITON": "triton",
    "EMULATION": "emulation",
    "MARLIN": "marlin",
}

#: Slots a backend's conversion fills with a placeholder the experts never read, but the
#: method's quantization config takes: slot -> (value, dtype). vLLM's EMULATION conversion
#: returns one-element fp16 ones for the scales (the weights are dequantized already).
PLACEHOLDERS: Mapping[str, Mapping[str, tuple[float, str]]] = {
    "EMULATION": {"w13_scales": (1.0, "float16"), "w2_scales": (1.0, "float16")},
}

#: The attribute holding the selected WNA16 backend, by the methods' two spellings.
BACKEND_ATTRIBUTES = ("wna16_backend", "wna16_moe_backend")


def parameter_names(method_class: str) -> Mapping[str, str]:
    """Slot -> parameter name for vLLM's MoE method `method_class` (KeyError: unknown)."""
    return PARAMETERS[method_class]
