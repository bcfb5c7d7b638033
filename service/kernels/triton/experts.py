"""TRITON: the experts backend that runs our own Triton WNA16 kernels on TRITON-layout weights.

It checks the layer's tensors once at prepare, then per forward picks the kernels and tiles
(`config_for`: the decode kernels for few routes per expert, else the prefill kernels with the
tuned table's tiles or the heuristic's) and launches them; nothing in a forward synchronises
with the host, so a forward can be captured in a CUDA graph.
"""

from __future__ import annotations

import functools
from typing import ClassVar, Self

import torch

from service.formats.canonical import QuantizedMoELayer
from service.kernels.activation import ResolvedActivation
from service.kernels.errors import KernelInputError, KernelUnavailableError
from service.kernels.interface import ExpertsBackend, KernelOptions, LayerSpec, LayerTensors
from service.kernels.triton import prefill_rs
from service.kernels.triton.config import (
    DECODE,
    MIN_BLOCK_K,
    PREFILL_RS,
    KernelConfig,
    choose_config,
    choose_config_decode,
    choose_config_rs,
    use_decode,
)
from service.kernels.triton.decode import DecodeWorkspace, fused_moe_decode
from service.kernels.triton.prefill import fused_moe
from service.kernels.triton.tuned import tuned_config, tuned_uses_kernel
from service.triton_runtime import fix_interpreter_index, interpreting, triton_unavailable_reason


@functools.cache
def _num_sms(device_index: int) -> int:
    return int(torch.cuda.get_device_properties(device_index).multi_processor_count)


class TritonWNA16Experts(ExpertsBackend):
    """Our fused WNA16 MoE kernel over TRITON-layout weights (int4/int8, zp, groups)."""

    name: ClassVar[str] = "TRITON"

    def __init__(
        self,
        config: KernelConfig | None = None,
        *,
        poison_workspace: bool = False,
        decode: bool = True,
        register_operand: bool = False,
    ):
        """`config` pins the tiles (tests, the tuner); `poison_workspace` fills the
        intermediate with NaN before each forward, so an unwritten element shows up;
        `decode` False keeps the dispatcher off the decode kernels (the tuned table and the
        prefill heuristic then serve every batch size); `register_operand` makes the
        register-operand prefill kernels (`prefill_rs.py`) the untuned prefill choice and
        re-lays the weights out for them at prepare (a second copy of the codes, scales and
        zero points, in our layout), where the layer allows it. A pinned or tuned config
        whose kernel is "prefill_rs" also gets the re-laid-out copy."""
        super().__init__()
        self._config = config
        self._poison = poison_workspace
        self._decode = decode
        self._register_operand = register_operand
        self._tensors: dict[str, torch.Tensor] = {}
        self._rs_tensors: dict[str, torch.Tensor] | None = None
        self._decode_workspace = DecodeWorkspace()

    @classmethod
    def configured(cls, options: KernelOptions) -> Self:
        return cls(decode=options.triton_decode)

    @classmethod
    def unavailable_reason(cls, device: torch.device) -> str | None:
        return triton_unavailable_reason(device)

    def _prepare(self, tensors: LayerTensors, spec: LayerSpec) -> None:
        if isinstance(tensors, QuantizedMoELayer):
            raise KernelInputError("layout", "TRITON reads TRITON-layout tensors by name")
        if spec.act_order:
            raise KernelUnavailableError(
                "TRITON", "act-order (g_idx) weights are not supported by the TRITON layout"
            )
        reason = triton_unavailable_reason(tensors["w13_qweight"].device)
        if reason is not None:
            raise KernelUnavailableError("TRITON", reason)
        self._tensors = check_triton_tensors(tensors, spec)
        self._rs_tensors = None
        wanted = self._register_operand or (
            self._config is not None and self._config.kernel == PREFILL_RS
        )
        device = self._tensors["w13_qweight"].device
        if prefill_rs.supports(spec) and (wanted or _tuned_uses_rs(device, spec)):
            self._rs_tensors = prefill_rs.relayout(self._tensors, spec)

    def _forward_into(
        self,
        hidden_states: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        activation: ResolvedActivation,
        out: torch.Tensor | None,
    ) -> torch.Tensor:
        spec, t = self.spec, self._tensors
        device = hidden_states.device
        if device != t["w13_qweight"].device:
            raise KernelInputError(
                "hidden_states", f"is on {device}, the layer on {t['w13_qweight'].device}"
            )
        m, top_k = topk_ids.shape
        config = self._config or self.config_for(m, top_k, device)
        if interpreting():
            fix_interpreter_index()
        if config.kernel == DECODE:
            return fused_moe_decode(
                hidden_states, topk_ids, topk_weights, t, spec, activation, config,
                self._decode_workspace, self._poison, out,
            )  # fmt: skip
        if config.kernel == PREFILL_RS:
            if self._rs_tensors is None:
                raise KernelUnavailableError(
                    "TRITON", "the register-operand prefill kernels need K and the group "
                    f"to be multiples of {prefill_rs.MIN_SUB}",
                )  # fmt: skip
            return prefill_rs.fused_moe_rs(
                hidden_states, topk_ids, topk_weights, self._rs_tensors, spec, activation,
                config, self._poison, out,
            )  # fmt: skip
        return fused_moe(
            hidden_states, topk_ids, topk_weights, t, spec, activation, config, self._poison, out
        )

    def config_for(self, num_tokens: int, top_k: int, device: torch.device) -> KernelConfig:
        """The tiles for this token count: the decode kernels' for few routes per expert
        (`use_decode`, unless this backend was made with `decode=False`), else the tuned
        table shipped in `configs/` for this device and layer shape when it has one (its
        rows name either prefill generation: v3's `prefill.py` or the register-operand
        `prefill_rs.py`, whichever measured faster), else the prefill heuristic (the
        register-operand one with `register_operand`)."""
        spec = self.spec
        num_sms = 4 if device.type != "cuda" else _num_sms(device.index or 0)
        if self._decode and use_decode(num_tokens, top_k, spec.num_experts):
            return choose_config_decode(num_tokens, top_k, spec, num_sms)
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
        tuned = tuned_config(name, spec, num_tokens, top_k)
        if tuned is not None and (tuned.kernel != PREFILL_RS or self._rs_tensors is not None):
            return tuned
        if self._register_operand and self._rs_tensors is not None:
            return choose_config_rs(num_tokens, top_k, spec, num_sms)
        return choose_config(num_tokens, top_k, spec, num_sms)


def _tuned_uses_rs(device: torch.device, spec: LayerSpec) -> bool:
    """Whether the tuned table of the layer's device has register-operand rows for it (then
    the layer is re-laid out for those kernels at prepare)."""
    if device.type != "cuda":
        return False
    return tuned_uses_kernel(torch.cuda.get_device_name(device), spec, PREFILL_RS)


def check_triton_shape(hidden: int, intermediate: int) -> None:
    """The sizes these kernels take: both K (hidden, intermediate) whole smallest K tiles."""
    if hidden % MIN_BLOCK_K or intermediate % MIN_BLOCK_K:
        raise KernelUnavailableError(
            "TRITON",
            f"hidden {hidden} and intermediate {intermediate} must be multiples of {MIN_BLOCK_K}",
        )


def check_triton_tensors(tensors: LayerTensors, spec: LayerSpec) -> dict[str, torch.Tensor]:
    """The TRITON-layout tensors, checked against the descriptor (dtype, shape, device)."""
    assert not isinstance(tensors, QuantizedMoELayer)
    e, h, i, bits = spec.num_experts, spec.hidden_size, spec.intermediate_size, spec.bits
    check_triton_shape(h, i)
    per_byte = 8 // bits
    dims = {"w13": (spec.w13_rows, h), "w2": (h, i)}
    out: dict[str, torch.Tensor] = {}
    device = None
    for name, (n, k) in dims.items():
        groups = 1 if spec.group_size == -1 else k // spec.group_size
        if spec.group_size != -1 and k % spec.group_size:
            raise KernelInputError("group_size", f"{spec.group_size} does not divide {k}")
        expected: dict[str, tuple[tuple[int, ...], tuple[torch.dtype, ...]]] = {
            f"{name}_qweight": ((e, n, k // per_byte), (torch.uint8,)),
            f"{name}_scales": ((e, n, groups), (torch.float16, torch.bfloat16, torch.float32)),
        }
        if spec.has_zero_points:
            zrows = n // 2 if bits == 4 else n
            expected[f"{name}_qzeros"] = ((e, zrows, groups), (torch.uint8,))
        if spec.has_bias:
            expected[f"{name}_bias"] = ((e, n), (torch.float16, torch.bfloat16, torch.float32))
        for key, (shape, dtypes) in expected.items():
            tensor = tensors.get(key)
            if tensor is None:
                raise KernelInputError(key, f"missing (have {sorted(tensors)})")
            if tuple(tensor.shape) != shape or tensor.dtype not in dtypes:
                raise KernelInputError(
                    key,
                    f"must be {[str(d).removeprefix('torch.') for d in dtypes]} {list(shape)}, "
                    f"got {tensor.dtype} {list(tensor.shape)}",
                )
            device = device or tensor.device
            if tensor.device != device:
                raise KernelInputError(key, f"is on {tensor.device}, the layer on {device}")
            out[key] = tensor.contiguous()
    return out
