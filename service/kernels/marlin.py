"""MARLIN: vLLM's compiled Marlin MoE GEMM (`_moe_C.moe_wna16_marlin_gemm`) on our MARLIN layout.

We do not ship the kernel: it is vLLM's CUDA code. vLLM 0.33.0's wheel carries it in
`vllm/_moe_C_stable_libtorch.abi3.so`, built against torch's stable ABI, so that one file loads
with `torch.ops.load_library` into other torch builds (the H200's 2.11 among them) and
registers the op without importing vLLM. We find it, in this order: an op already registered
(vLLM imported, or loaded before); the path in `MOE_CONTROL_MARLIN_LIBRARY` (the settings'
`marlin_library`); the file inside an installed `vllm` package (found without importing it).

What we replicate around the two GEMM calls is vLLM's `fused_marlin_moe` /
`_fused_marlin_moe` (fused_moe/experts/marlin_moe.py), with our own alignment:

* the M block size: the first of 8, 16, 32, 48, 64 with ``M * topk / E / block < 0.9``;
* the workspace: int32 zeros, 4 per multiprocessor (`marlin_make_workspace_new(device, 4)`);
  Marlin resets its locks at the end of each call, so calls ordered on one stream reuse it;
* GEMM1 over the hidden states with `top_k` = k (row i of the sorted ids is token i // k),
  writing [M*k, 2I]; the activation (our shared table) into [M*k, I]; GEMM2 with `top_k` 1
  over those rows, multiplying each row by its router weight (`mul_topk_weights`), writing
  [M*k, H]; then the sum over the k rows of each token (vLLM's `torch.sum(..., out=)`).
* fp32 reduction (`use_fp32_reduce=True`), no atomic adds, integer zero points.

The weight type goes to the op as vLLM's `ScalarType` id, which we compute from vLLM's
documented bit layout (csrc/core/scalar_type.hpp, vllm/scalar_type.py `ScalarType.id`):
``exponent | mantissa << 8 | signed << 16 | bias << 17 | finite_values_only << 49 |
nan_repr << 50``. Integer types have exponent 0, mantissa = bits and NaN representation
IEEE-754 (1), so uint4 = 2**50 + 4 << 8 and uint4b8 adds the bias 8 << 17.

vLLM 0.33's op has no act-order inputs (g_idx / sort indices / is_k_full are gone, and vLLM
0.33 refuses GPTQ ``desc_act=True`` checkpoints outright), so act-order layers are refused.
"""

from __future__ import annotations

import importlib.util
import os
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import torch

from service.kernels.activation import ResolvedActivation
from service.kernels.activation import apply as apply_activation
from service.kernels.align import Alignment, align_block_size
from service.kernels.errors import KernelInputError, KernelUnavailableError
from service.kernels.interface import (
    ExpertsBackend,
    LayerSpec,
    LayerTensors,
    cuda_unavailable_reason,
)
from service.settings import Settings, worker_setting

BACKEND = "MARLIN"
LIBRARY_ENV = Settings.env_name("marlin_library")
LIBRARY_NAME = "_moe_C_stable_libtorch.abi3.so"
OP_NAMESPACE = "_moe_C"
OP_NAME = "moe_wna16_marlin_gemm"
MIN_CAPABILITY = (7, 5)
TILE = 16
"""Marlin's k tile: a repacked weight has one row per 16 input channels."""
BLOCK_SIZES_M = (8, 16, 32, 48, 64)
"""vLLM's candidate M block sizes, smallest first (`fused_marlin_moe`)."""
BLOCK_FILL = 0.9
MAX_BLOCKS_PER_SM = 4
"""vLLM's `MARLIN_MAX_BLOCKS_PER_SM`: the workspace holds this many locks per SM."""

NAN_IEEE_754 = 1


@dataclass(frozen=True)
class ScalarType:
    """vLLM's `ScalarType`, reduced to what its integer id encodes."""

    exponent: int
    mantissa: int
    signed: bool
    bias: int
    finite_values_only: bool = False
    nan_repr: int = NAN_IEEE_754

    @property
    def id(self) -> int:
        return (
            self.exponent
            | self.mantissa << 8
            | int(self.signed) << 16
            | self.bias << 17
            | int(self.finite_values_only) << 49
            | self.nan_repr << 50
        )


UINT4 = ScalarType(exponent=0, mantissa=4, signed=False, bias=0)
UINT4B8 = ScalarType(exponent=0, mantissa=4, signed=False, bias=8)
UINT8B128 = ScalarType(exponent=0, mantissa=8, signed=False, bias=128)

WEIGHT_TYPES: dict[tuple[int, bool], ScalarType] = {
    (4, True): UINT4,  # explicit zero points
    (4, False): UINT4B8,  # symmetric: the midpoint 8 is subtracted
    (8, False): UINT8B128,
}
"""(bits, has zero points) -> the type vLLM passes (`MarlinExpertsBase.quant_type_id`).
vLLM's Marlin MoE has no 8-bit zero-point type (`fused_marlin_moe` asserts on uint8)."""

_LOCK = threading.Lock()


def _registered_op() -> Callable[..., torch.Tensor] | None:
    namespace = getattr(torch.ops, OP_NAMESPACE)
    try:
        op: Callable[..., torch.Tensor] = getattr(namespace, OP_NAME)
    except (AttributeError, RuntimeError):
        return None
    return op


def find_library(environ: Mapping[str, str] | None = None) -> Path | None:
    """Where vLLM's MoE ops library is: the configured path, else an installed vLLM's."""
    env = os.environ if environ is None else environ
    configured: Path | None = worker_setting("marlin_library", env)
    if configured is not None:
        return configured
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        candidate = Path(location) / LIBRARY_NAME
        if candidate.is_file():
            return candidate
    return None


def load_op(library: str | Path | None = None) -> Callable[..., torch.Tensor]:
    """The registered `_moe_C.moe_wna16_marlin_gemm`, loading vLLM's library if needed.

    Raises `KernelUnavailableError` with the reason when there is no such library or it
    does not load (no CUDA runtime, an incompatible torch).
    """
    with _LOCK:
        op = _registered_op()
        if op is not None:
            return op
        path = Path(library) if library is not None else find_library()
        if path is None:
            raise KernelUnavailableError(
                BACKEND,
                f"vLLM's {LIBRARY_NAME} was not found: install vllm==0.33.0 or set "
                f"{LIBRARY_ENV} to the file (scripts/prepare_gpu_deps.sh extracts it)",
            )
        if not path.is_file():
            raise KernelUnavailableError(BACKEND, f"{LIBRARY_ENV}: no such file {path}")
        try:
            torch.ops.load_library(str(path))  # type: ignore[no-untyped-call]
        except (OSError, RuntimeError) as exc:
            raise KernelUnavailableError(BACKEND, f"loading {path} failed: {exc}") from None
        op = _registered_op()
        if op is None:
            raise KernelUnavailableError(
                BACKEND, f"{path} loaded but registered no {OP_NAMESPACE}.{OP_NAME}"
            )
        return op


def choose_block_size_m(num_tokens: int, top_k: int, num_experts: int) -> int:
    """vLLM's M block size: the first candidate whose blocks are under 90% full on average."""
    for block in BLOCK_SIZES_M:
        if num_tokens * top_k / num_experts / block < BLOCK_FILL:
            return block
    return BLOCK_SIZES_M[-1]


def weight_type(bits: int, has_zero_points: bool) -> ScalarType:
    scalar = WEIGHT_TYPES.get((bits, has_zero_points))
    if scalar is None:
        raise KernelUnavailableError(
            BACKEND, f"vLLM's Marlin MoE has no {bits}-bit type with zero points"
        )
    return scalar


def _multiprocessors(device: torch.device) -> int:
    return int(torch.cuda.get_device_properties(device).multi_processor_count)


@dataclass(frozen=True)
class _Projection:
    """One projection's MARLIN tensors, as the GEMM takes them."""

    weight: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor | None
    bias: torch.Tensor | None

    def cast(self, dtype: torch.dtype) -> _Projection:
        """Scales and bias in the activation dtype: the kernel reads them as such (vLLM keeps
        them in the model's params_dtype)."""
        return _Projection(
            weight=self.weight,
            scales=self.scales.to(dtype).contiguous(),
            zeros=self.zeros,
            bias=None if self.bias is None else self.bias.to(dtype).contiguous(),
        )


class MarlinExperts(ExpertsBackend):
    """Runs a MARLIN-layout layer through vLLM's compiled Marlin MoE GEMM."""

    name: ClassVar[str] = BACKEND

    def __init__(self, library: str | Path | None = None) -> None:
        super().__init__()
        self._library = library
        self._op: Callable[..., torch.Tensor] | None = None
        self._projections: dict[torch.dtype | None, tuple[_Projection, _Projection]] = {}
        self._padded_intermediate = 0
        self._scalar: ScalarType = UINT4B8
        self._workspaces: dict[tuple[torch.device, int], torch.Tensor] = {}
        self._lock = threading.Lock()

    @classmethod
    def unavailable_reason(cls, device: torch.device) -> str | None:
        reason = cuda_unavailable_reason(
            device, "vLLM's Marlin MoE kernel needs a CUDA GPU", MIN_CAPABILITY
        )
        if reason is not None:
            return reason
        try:
            load_op()
        except KernelUnavailableError as exc:
            return exc.description
        return None

    def _prepare(self, tensors: LayerTensors, spec: LayerSpec) -> None:
        if not isinstance(tensors, Mapping):
            raise KernelInputError("layout", f"{self.name} reads the MARLIN writer's tensors")
        if spec.act_order:
            raise KernelUnavailableError(
                self.name,
                "vLLM 0.33's Marlin MoE GEMM takes no act-order (g_idx) inputs, and vLLM 0.33 "
                "rejects desc_act checkpoints",
            )
        self._scalar = weight_type(spec.bits, spec.has_zero_points)
        w13, w2, padded = _read_projections(tensors, spec)
        self._require_cuda(w13.weight)
        self._op = load_op(self._library)
        self._projections = {None: (w13, w2)}
        self._padded_intermediate = padded
        self._workspaces = {}

    @staticmethod
    def _require_cuda(weight: torch.Tensor) -> None:
        if weight.device.type != "cuda":
            raise KernelUnavailableError(BACKEND, "the layer's tensors must be on a CUDA GPU")

    def _for_dtype(self, dtype: torch.dtype) -> tuple[_Projection, _Projection]:
        with self._lock:
            found = self._projections.get(dtype)
            if found is None:
                w13, w2 = self._projections[None]
                found = (w13.cast(dtype), w2.cast(dtype))
                self._projections[dtype] = found
        return found

    def _workspace(self, device: torch.device) -> torch.Tensor:
        key = (device, torch.cuda.current_stream(device).stream_id)
        with self._lock:
            workspace = self._workspaces.get(key)
            if workspace is None:
                size = _multiprocessors(device) * MAX_BLOCKS_PER_SM
                workspace = torch.zeros(size, dtype=torch.int32, device=device)
                self._workspaces[key] = workspace
        return workspace

    def _forward_into(
        self,
        hidden_states: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        activation: ResolvedActivation,
        out: torch.Tensor | None,
    ) -> torch.Tensor:
        m, hidden = hidden_states.shape
        top_k = int(topk_ids.shape[1])
        block = choose_block_size_m(m, top_k, self.spec.num_experts)
        aligned = align_block_size(topk_ids, block, self.spec.num_experts)
        down = self._gemm_pair(hidden_states, aligned, topk_weights, top_k, activation)
        output = torch.empty_like(hidden_states) if out is None else out
        return torch.sum(down.view(m, top_k, hidden), dim=1, out=output)

    def _gemm_pair(
        self,
        inputs: torch.Tensor,
        aligned: Alignment,
        topk_weights: torch.Tensor,
        top_k: int,
        activation: ResolvedActivation,
    ) -> torch.Tensor:
        """vLLM's `_fused_marlin_moe`: GEMM1 over `inputs` [rows, H] with `top_k` routes per
        row, the activation, GEMM2 with the router weights multiplied in; [rows*top_k, H]."""
        op, spec = self._op, self.spec
        assert op is not None
        dtype, device = inputs.dtype, inputs.device
        w13, w2 = self._for_dtype(dtype)
        if w13.weight.device != device:
            raise KernelInputError(
                "hidden_states", f"is on {device}, the layer on {w13.weight.device}"
            )
        rows = int(inputs.shape[0]) * top_k
        n = self._padded_intermediate
        n13 = 2 * n if spec.gated else n
        call = _Call(
            op=op,
            scalar_id=self._scalar.id,
            workspace=self._workspace(device),
            aligned=aligned,
            topk_weights=topk_weights,
        )
        gate_up = torch.empty((rows, n13), dtype=dtype, device=device)
        call.gemm(inputs, gate_up, w13, top_k=top_k, mul_topk_weights=False)
        activated = apply_activation(gate_up.float(), activation).to(dtype)
        down = torch.empty((rows, spec.hidden_size), dtype=dtype, device=device)
        call.gemm(activated, down, w2, top_k=1, mul_topk_weights=True)
        return down


@dataclass(frozen=True)
class _Call:
    """What both GEMMs of one forward share."""

    op: Callable[..., torch.Tensor]
    scalar_id: int
    workspace: torch.Tensor
    aligned: Alignment
    topk_weights: torch.Tensor

    def gemm(
        self,
        inputs: torch.Tensor,
        output: torch.Tensor,
        projection: _Projection,
        *,
        top_k: int,
        mul_topk_weights: bool,
    ) -> None:
        """output [size_m * top_k, N] = routed rows of inputs [size_m, K] times the experts."""
        size_m, size_k = inputs.shape
        self.op(
            inputs,
            output,
            projection.weight,
            projection.bias,
            projection.scales,
            None,  # a_scales: 16-bit activations
            None,  # global_scale: NVFP4 only
            projection.zeros,
            self.workspace,
            self.aligned.sorted_ids,
            self.aligned.expert_ids,
            self.aligned.num_tokens_post_padded,
            self.topk_weights,
            self.aligned.block_size,
            top_k,
            mul_topk_weights,
            self.scalar_id,
            size_m,
            output.shape[1],
            size_k,
            False,  # use_atomic_add
            True,  # use_fp32_reduce
            False,  # is_zp_float
            -1,  # thread_k: the kernel chooses
            -1,  # thread_n
            -1,  # blocks_per_sm
        )


_NAMES = {
    "w13": ("w13_qweight", "w13_scales", "w13_qzeros", "w13_bias"),
    "w2": ("w2_qweight", "w2_scales", "w2_qzeros", "w2_bias"),
}


def _read_projections(
    tensors: Mapping[str, torch.Tensor], spec: LayerSpec
) -> tuple[_Projection, _Projection, int]:
    """The MARLIN writer's tensors, checked; and the padded intermediate size they hold."""
    projections: dict[str, _Projection] = {}
    for key, (weight_name, scale_name, zero_name, bias_name) in _NAMES.items():
        for name in (weight_name, scale_name):
            if name not in tensors:
                raise KernelInputError(name, "missing from the MARLIN layer")
        weight = tensors[weight_name]
        if weight.dtype != torch.int32 or weight.dim() != 3:
            raise KernelInputError(
                weight_name, f"must be int32 [E, K/16, N*bits/2], got {weight.dtype}"
            )
        if weight.shape[0] != spec.num_experts:
            raise KernelInputError(
                weight_name, f"has {weight.shape[0]} experts, not {spec.num_experts}"
            )
        zeros = tensors.get(zero_name) if spec.has_zero_points else None
        if spec.has_zero_points and zeros is None:
            raise KernelInputError(zero_name, "zero points are missing")
        projections[key] = _Projection(
            weight=weight.contiguous(),
            scales=tensors[scale_name].contiguous(),
            zeros=None if zeros is None else zeros.contiguous(),
            bias=tensors.get(bias_name) if spec.has_bias else None,
        )
    w13, w2 = projections["w13"], projections["w2"]
    if w13.weight.shape[1] * TILE != spec.hidden_size:
        raise KernelInputError(
            "w13_qweight",
            f"holds K={w13.weight.shape[1] * TILE}, the hidden size is {spec.hidden_size}",
        )
    if w2.weight.shape[2] // (spec.bits // 2) != spec.hidden_size:
        raise KernelInputError("w2_qweight", f"does not hold N={spec.hidden_size}")
    padded = int(w2.weight.shape[1]) * TILE
    if padded < spec.intermediate_size:
        raise KernelInputError("w2_qweight", f"holds I={padded} < {spec.intermediate_size}")
    return w13, w2, padded
