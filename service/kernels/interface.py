"""One interface for every MoE experts backend: prepare a converted layer, then run forwards.

The worker holds converted layers by id and runs them with whichever backend the oracle
chose, so every backend must take the same inputs and give the same answer:

* `prepare(tensors, spec)`: the layer's converted tensors (a name -> tensor mapping in the
  backend's kernel layout, or the canonical `QuantizedMoELayer`) and the `LayerSpec`
  descriptor that says what they hold. Done once per layer; checks shapes and dtypes.
* `forward(hidden_states [M, H] bf16/fp16, topk_ids [M, k] int32, topk_weights [M, k] fp32,
  activation) -> [M, H]` in the dtype of `hidden_states`: the whole fused MoE forward,
  gate/up GEMM, activation, down GEMM and the router-weighted sum over the k experts.

Input checks live here, once, so a bad request fails the same way whatever the backend and
before anything is launched (the worker stays healthy). `validate=True` adds the checks that
need to read device memory (NaN/Inf, expert ids in range); they cost a synchronisation, so
they are opt-in.
"""

from __future__ import annotations

import abc
import importlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar, Self, TypeAlias

import torch

from service.formats.canonical import QuantizedMoELayer
from service.kernels import registry
from service.kernels.activation import ActivationSpec, ResolvedActivation, resolve
from service.kernels.errors import KernelInputError

HIDDEN_DTYPES = (torch.bfloat16, torch.float16)
ID_DTYPES = (torch.int32, torch.int64)

#: What `prepare` reads: kernel-layout tensors by name, or the canonical layer.
LayerTensors: TypeAlias = Mapping[str, torch.Tensor] | QuantizedMoELayer


@dataclass(frozen=True, slots=True)
class LayerSpec:
    """The descriptor of a converted layer: its shape, its quantization and its layout.

    `group_size` is -1 for channelwise scales. `gated` says whether w13 holds gate and up rows
    (2I) or only up rows (I, for the `_no_mul` activations). `layout` names the kernel format
    the tensors are in ("TRITON" for vLLM's Triton WNA16 layout, "CANONICAL" for the
    layout-neutral form).
    """

    num_experts: int
    hidden_size: int
    intermediate_size: int
    bits: int
    group_size: int
    has_zero_points: bool = False
    has_bias: bool = False
    gated: bool = True
    act_order: bool = False
    layout: str = "TRITON"

    @property
    def w13_rows(self) -> int:
        return 2 * self.intermediate_size if self.gated else self.intermediate_size

    @classmethod
    def from_canonical(cls, layer: QuantizedMoELayer, *, layout: str = "CANONICAL") -> LayerSpec:
        """The descriptor of a canonical layer (gated when w13 has twice w2's K rows)."""
        w13, w2 = layer.w13, layer.w2
        if w13.group_size != w2.group_size and -1 not in (w13.group_size, w2.group_size):
            raise KernelInputError("group_size", "w13 and w2 group sizes differ")
        return cls(
            num_experts=w13.num_experts,
            hidden_size=layer.hidden_size,
            intermediate_size=layer.intermediate_size,
            bits=w13.bits,
            group_size=w13.group_size,
            has_zero_points=w13.zeros is not None,
            has_bias=w13.bias is not None or w2.bias is not None,
            gated=w13.n == 2 * w2.k,
            act_order=w13.g_idx is not None or w2.g_idx is not None,
            layout=layout,
        )


@dataclass(frozen=True, slots=True)
class KernelOptions:
    """Process-wide choices the worker hands to every backend it makes (read once, at the
    worker's edge: kernels never read the environment themselves)."""

    triton_decode: bool = True
    """Whether TRITON may take its decode kernels for few routes per expert."""


class ExpertsBackend(abc.ABC):
    """A runnable fused-MoE experts implementation for one prepared layer.

    Subclasses implement `_prepare` and `_forward_into`; this class checks every input first.
    """

    #: The backend's name as the oracle spells it ("EMULATION", "TRITON", ...).
    name: ClassVar[str]
    #: The layouts `prepare` reads, and whether a forward may be captured in a CUDA graph:
    #: both set from the class's row of the backend table (`service.kernels.registry`),
    #: the one place these facts are written.
    layouts: ClassVar[frozenset[str]] = frozenset()
    graph_capturable: ClassVar[bool] = False
    #: Whether `prepare` also takes the layout-neutral canonical layer ("CANONICAL"), which
    #: no converter writes and so no row of the table names.
    reads_canonical: ClassVar[bool] = False

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        path = f"{cls.__module__}:{cls.__qualname__}"
        row = registry.class_row(path)
        canonical = frozenset({"CANONICAL"}) if cls.reads_canonical else frozenset()
        cls.layouts = registry.layouts_run_by(path) | canonical
        cls.graph_capturable = row is not None and row.graph_capturable

    def __init__(self) -> None:
        self._spec: LayerSpec | None = None

    @classmethod
    def configured(cls, options: KernelOptions) -> Self:
        """A new backend set up by `options` (a backend ignores the options of others)."""
        return cls()

    @property
    def spec(self) -> LayerSpec:
        if self._spec is None:
            raise KernelInputError("layer", f"{self.name}: no layer prepared")
        return self._spec

    @classmethod
    def unavailable_reason(cls, device: torch.device) -> str | None:
        """Why this backend cannot run on `device`, or None when it can."""
        return None

    def prepare(self, tensors: LayerTensors, spec: LayerSpec) -> None:
        """Check and keep a converted layer (and derive what the kernels need from it)."""
        if spec.layout not in self.layouts:
            raise KernelInputError(
                "layout", f"{self.name} reads {sorted(self.layouts)}, not {spec.layout!r}"
            )
        if spec.bits not in (4, 8):
            raise KernelInputError("bits", f"must be 4 or 8, got {spec.bits}")
        self._prepare(tensors, spec)
        self._spec = spec

    def forward(
        self,
        hidden_states: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        activation: str | ActivationSpec = "silu",
        *,
        validate: bool = False,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The fused MoE forward: [M, H] in, [M, H] out, in the dtype of `hidden_states`.

        `out`, when given, is the [M, H] tensor the result is written into (and returned);
        tests poison it with NaN first to see that every element gets written.
        """
        spec = self.spec
        act = resolve(activation)
        check_inputs(spec, act, hidden_states, topk_ids, topk_weights, validate=validate)
        if out is not None and (
            out.shape != hidden_states.shape
            or out.dtype != hidden_states.dtype
            or out.device != hidden_states.device
            or not out.is_contiguous()
        ):
            raise KernelInputError(
                "out", "must be a contiguous tensor like hidden_states (shape, dtype, device)"
            )
        if topk_ids.dtype != torch.int32:
            topk_ids = topk_ids.to(torch.int32)
        if hidden_states.shape[0] == 0:
            return torch.empty_like(hidden_states) if out is None else out
        return self._forward_into(
            hidden_states.contiguous(),
            topk_ids.contiguous(),
            topk_weights.contiguous(),
            act,
            out,
        )

    @abc.abstractmethod
    def _prepare(self, tensors: LayerTensors, spec: LayerSpec) -> None: ...

    @abc.abstractmethod
    def _forward_into(
        self,
        hidden_states: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        activation: ResolvedActivation,
        out: torch.Tensor | None,
    ) -> torch.Tensor:
        """The forward on checked, contiguous inputs, written into `out` when given (else a
        new [M, H] tensor). The one hook: kernels that can write the caller's tensor directly
        do so, the others copy their result in (`into`)."""


def cuda_unavailable_reason(
    device: torch.device, off_cuda: str, min_capability: tuple[int, int]
) -> str | None:
    """Why a CUDA-only kernel cannot run on `device` (`off_cuda`: what it says of a device
    that is not a CUDA GPU), or None on a CUDA GPU of `min_capability` or newer."""
    if device.type != "cuda":
        return off_cuda
    if not torch.cuda.is_available():
        return "CUDA is not available in this process"
    capability = torch.cuda.get_device_capability(device)
    if capability < min_capability:
        needed = f"{min_capability[0]}.{min_capability[1]}"
        return f"needs compute capability {needed} or newer, this GPU has {capability}"
    return None


def into(result: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """`result`, or `out` holding it: for backends whose kernels cannot write `out`."""
    return result if out is None else out.copy_(result)


def check_inputs(
    spec: LayerSpec,
    act: ResolvedActivation,
    hidden_states: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    *,
    validate: bool,
) -> None:
    """Every check a forward's inputs must pass; raises `KernelInputError` naming the field."""
    if act.gated != spec.gated:
        kind = "gated" if act.gated else "non-gated"
        rows = "2I" if act.gated else "I"
        raise KernelInputError(
            "activation",
            f"{act.name} is {kind} and needs w13 with {rows} rows; this layer's w13 has "
            f"{spec.w13_rows} rows for I={spec.intermediate_size}",
        )
    if hidden_states.dim() != 2:
        raise KernelInputError(
            "hidden_states", f"must be 2-D [M, H], got shape {list(hidden_states.shape)}"
        )
    if hidden_states.dtype not in HIDDEN_DTYPES:
        raise KernelInputError(
            "hidden_states", f"must be bfloat16 or float16, got {hidden_states.dtype}"
        )
    m, h = hidden_states.shape
    if h != spec.hidden_size:
        raise KernelInputError(
            "hidden_states", f"hidden size {h} does not match the layer's {spec.hidden_size}"
        )
    if topk_ids.dim() != 2 or topk_ids.shape[0] != m:
        raise KernelInputError("topk_ids", f"must be [M={m}, k], got {list(topk_ids.shape)}")
    if topk_ids.dtype not in ID_DTYPES:
        raise KernelInputError("topk_ids", f"must be int32, got {topk_ids.dtype}")
    k = topk_ids.shape[1]
    if not 1 <= k <= spec.num_experts:
        raise KernelInputError(
            "topk_ids", f"top-k must be 1..{spec.num_experts} (the expert count), got {k}"
        )
    if tuple(topk_weights.shape) != (m, k):
        raise KernelInputError(
            "topk_weights", f"must be [{m}, {k}] like topk_ids, got {list(topk_weights.shape)}"
        )
    if topk_weights.dtype != torch.float32:
        raise KernelInputError("topk_weights", f"must be float32, got {topk_weights.dtype}")
    device = hidden_states.device
    for field, tensor in (("topk_ids", topk_ids), ("topk_weights", topk_weights)):
        if tensor.device != device:
            raise KernelInputError(field, f"is on {tensor.device}, hidden_states on {device}")
    if validate and m:
        check_values(spec, hidden_states, topk_ids, topk_weights)


def check_values(
    spec: LayerSpec,
    hidden_states: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
) -> None:
    """The checks that read device memory: finite inputs, expert ids in range."""
    if not bool(torch.isfinite(hidden_states).all()):
        raise KernelInputError("hidden_states", "contains NaN or Inf")
    if not bool(torch.isfinite(topk_weights).all()):
        raise KernelInputError("topk_weights", "contains NaN or Inf")
    low, high = int(topk_ids.min()), int(topk_ids.max())
    if low < 0 or high >= spec.num_experts:
        raise KernelInputError(
            "topk_ids", f"expert ids must be in [0, {spec.num_experts}), got [{low}, {high}]"
        )


def load_backend_class(path: str) -> type[ExpertsBackend]:
    """The `ExpertsBackend` subclass named ``module:Class`` (a row of the backend table)."""
    module, _, name = path.partition(":")
    cls: type[ExpertsBackend] = getattr(importlib.import_module(module), name)
    return cls
