"""HUMMING: humming-kernels' indexed MoE GEMM on a layer from our HUMMING writer.

vLLM 0.33 puts HUMMING first on SM90 (H100/H200) when humming-kernels is installed, so this is
the kernel those GPUs really run for WNA16 MoE. We call humming's public forward
(`humming.forward.humming_forward`) the way vLLM's `HummingIndexedExperts.apply`
(fused_moe/experts/fused_humming_moe.py) does, with our own alignment and buffers:

* compute config ``{"use_batch_invariant": false, "use_f16_accum": false,
  "gemm_type": "indexed"}``; tuning intervals from humming's own heuristics
  (`humming.tune.get_heuristics_config`, indexed GEMM), one list per projection;
* ``valid_shape_m`` = M·k (the routed rows); the M block size is the ``block_shape[0]`` of
  the w13 interval holding it (64 when none does), the w2 GEMM realigns when its interval
  says otherwise;
* GEMM1 reads the hidden states through the sorted ids with ``top_k`` = k and writes
  [M·k, 2I] (unpadded N); the activation gives [M·k, I]; GEMM2 with ``top_k`` 1 writes
  [M·k, H]; the router weights are applied in the final sum over the k rows of each token
  (vLLM's `moe_fused_mul_sum`), in float32;
* Stream-K locks: int32 zeros, 8 per multiprocessor (vLLM's `create_humming_locks`), one set
  per stream, since separate streams may run the same layer at once.

Humming compiles each (layer, tuning) kernel on first use (seconds, cached on disk). vLLM
hands it the whole interval list, which compiles every interval's kernel at the first
forward; we hand it the interval the call falls in (plus the one holding M = 1, which
humming's launcher reads first), so a forward compiles only what it runs (`warm_up` compiles
the intervals of given token counts in parallel). The kernels and the numbers are the same.

The activation runs in torch on GEMM1's output (our shared table), where vLLM fuses it into
humming's input processing; the GEMMs are humming's either way.
"""

from __future__ import annotations

import importlib
import json
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from service.formats.writers.humming import CONFIG_SUFFIX, config_from_tensor
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

BACKEND = "HUMMING"
MIN_CAPABILITY = (7, 5)
DEFAULT_BLOCK_M = 64
LOCKS_PER_SM = 8
COMPUTE_CONFIG = json.dumps(
    {"use_batch_invariant": False, "use_f16_accum": False, "gemm_type": "indexed"}
)
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}
"""humming's c_dtype names -> the activation dtype the layer was built for."""


def _humming(module: str) -> Any:
    """A humming module, imported on first use (it has no type stubs, and probes the GPU)."""
    return importlib.import_module(module)


def humming_unavailable_reason() -> str | None:
    try:
        _humming("humming")
    except ImportError as exc:
        return f"humming-kernels is not installed ({exc})"
    except Exception as exc:  # its import probes the device and may fail without a driver
        return f"humming-kernels does not import here: {exc}"
    return None


@dataclass(frozen=True)
class _Projection:
    """One projection: humming's layer config, its kernel tensors and its tuning intervals."""

    config: Any  # humming.config.LayerConfig
    weight: torch.Tensor
    weight_scale: torch.Tensor | None
    zero_point: torch.Tensor | None
    bias: torch.Tensor | None
    intervals: list[tuple[int, int, dict[str, Any]]]

    def interval(self, valid_m: int) -> tuple[int, int, dict[str, Any]] | None:
        for low, high, tuning in self.intervals:
            if low < valid_m <= high:
                return low, high, tuning
        return None

    def block_m(self, valid_m: int) -> int:
        found = self.interval(valid_m)
        return DEFAULT_BLOCK_M if found is None else int(found[2]["block_shape"][0])

    def chosen(self, valid_ms: Iterable[int]) -> list[list[Any]]:
        """The intervals these row counts fall in, plus the one holding M = 1: humming's
        launcher first reads its base kernel data at M = 1 (`launch_kernel_impl`), so every
        list it gets must cover 1."""
        picked: dict[tuple[int, int], list[Any]] = {}
        for m in (1, *valid_ms):
            found = self.interval(m)
            if found is None:
                return [list(entry) for entry in self.intervals]
            picked[found[:2]] = list(found)
        return sorted(picked.values(), key=lambda entry: int(entry[0]))

    def tuning(self, valid_m: int) -> str:
        return json.dumps(self.chosen([valid_m]))


class HummingExperts(ExpertsBackend):
    """Runs a HUMMING-layout layer through humming-kernels' indexed MoE GEMM."""

    name: ClassVar[str] = BACKEND

    def __init__(self) -> None:
        super().__init__()
        self._w13: _Projection | None = None
        self._w2: _Projection | None = None
        self._dtype: torch.dtype = torch.bfloat16
        self._locks: dict[tuple[torch.device, int], torch.Tensor] = {}
        self._lock = threading.Lock()

    @classmethod
    def unavailable_reason(cls, device: torch.device) -> str | None:
        reason = cuda_unavailable_reason(device, "humming-kernels needs a CUDA GPU", MIN_CAPABILITY)
        if reason is not None:
            return reason
        return humming_unavailable_reason()

    def _prepare(self, tensors: LayerTensors, spec: LayerSpec) -> None:
        if not isinstance(tensors, Mapping):
            raise KernelInputError("layout", "HUMMING reads the HUMMING writer's tensors")
        if spec.act_order:
            raise KernelUnavailableError(BACKEND, "humming has no act-order (g_idx) path")
        reason = humming_unavailable_reason()
        if reason is not None:
            raise KernelUnavailableError(BACKEND, reason)
        w13 = _projection(tensors, "w13")
        w2 = _projection(tensors, "w2")
        _check_shapes(w13, w2, spec)
        c_dtype = str(w13.config.c_dtype)
        if c_dtype not in DTYPES:
            raise KernelInputError("w13_humming_config", f"unexpected output dtype {c_dtype}")
        self._w13, self._w2 = w13, w2
        self._dtype = DTYPES[c_dtype]
        self._locks = {}

    @property
    def dtype(self) -> torch.dtype:
        """The activation dtype the layer was converted for (humming builds per dtype)."""
        return self._dtype

    def _stream_locks(self, device: torch.device) -> torch.Tensor:
        key = (device, torch.cuda.current_stream(device).stream_id)
        with self._lock:
            locks = self._locks.get(key)
            if locks is None:
                sms = torch.cuda.get_device_properties(device).multi_processor_count
                locks = torch.zeros(sms * LOCKS_PER_SM, dtype=torch.int32, device=device)
                self._locks[key] = locks
        return locks

    def warm_up(self, token_counts: Iterable[int], top_k: int) -> None:
        """Compile, in parallel, the kernels that forwards of these token counts will run."""
        kernel_class = _humming("humming.kernel.humming").HummingKernel
        w13, w2 = self._w13, self._w2
        if w13 is None or w2 is None:
            raise KernelInputError("layer", f"{BACKEND}: no layer prepared")
        device = w13.weight.device
        for projection in (w13, w2):
            listed = projection.chosen(m * top_k for m in token_counts)
            # Compiling as a list builds every kernel at once (humming compiles in threads);
            # the per-interval lists `forward` passes then load them from humming's disk cache.
            with torch.cuda.device(device):
                kernel_class.prepare_kernels(
                    projection.config.to_str(), COMPUTE_CONFIG, json.dumps(listed), device
                )

    def _forward_into(
        self,
        hidden_states: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        activation: ResolvedActivation,
        out: torch.Tensor | None,
    ) -> torch.Tensor:
        humming_forward = _humming("humming.forward").humming_forward
        w13, w2, spec = self._w13, self._w2, self.spec
        assert w13 is not None and w2 is not None
        device = hidden_states.device
        if w13.weight.device != device:
            raise KernelInputError(
                "hidden_states", f"is on {device}, the layer on {w13.weight.device}"
            )
        if hidden_states.dtype != self._dtype:
            raise KernelInputError(
                "hidden_states",
                f"this HUMMING layer was converted for {self._dtype}, got {hidden_states.dtype}",
            )
        m, hidden = hidden_states.shape
        top_k = int(topk_ids.shape[1])
        rows = m * top_k
        locks = self._stream_locks(device)
        aligned13 = align_block_size(topk_ids, w13.block_m(rows), spec.num_experts)
        block2 = w2.block_m(rows)
        aligned2 = (
            aligned13
            if block2 == aligned13.block_size
            else align_block_size(topk_ids, block2, spec.num_experts)
        )

        gate_up = torch.empty((rows, spec.w13_rows), dtype=self._dtype, device=device)
        self._gemm(
            humming_forward,
            w13,
            inputs=hidden_states,
            outputs=gate_up,
            aligned=aligned13,
            locks=locks,
            top_k=top_k,
            valid_m=rows,
        )
        activated = apply_activation(gate_up.float(), activation).to(self._dtype)
        down = torch.empty((rows, hidden), dtype=self._dtype, device=device)
        self._gemm(
            humming_forward,
            w2,
            inputs=activated,
            outputs=down,
            aligned=aligned2,
            locks=locks,
            top_k=1,
            valid_m=rows,
        )
        weighted = down.view(m, top_k, hidden).float() * topk_weights.unsqueeze(-1)
        result = weighted.sum(dim=1)
        return result.to(self._dtype) if out is None else out.copy_(result)

    @staticmethod
    def _gemm(
        forward: Any,
        projection: _Projection,
        *,
        inputs: torch.Tensor,
        outputs: torch.Tensor,
        aligned: Alignment,
        locks: torch.Tensor,
        top_k: int,
        valid_m: int,
    ) -> None:
        forward(
            projection.config,
            inputs=inputs,
            weight=projection.weight,
            weight_scale=projection.weight_scale,
            zero_point=projection.zero_point,
            bias=projection.bias,
            outputs=outputs,
            sorted_ids=aligned.sorted_ids,
            expert_ids=aligned.expert_ids,
            num_tokens_padded=aligned.num_tokens_post_padded,
            locks=locks,
            top_k=top_k,
            valid_shape_m=valid_m,
            compute_config=COMPUTE_CONFIG,
            tuning_config=projection.tuning(valid_m),
        )


def _projection(tensors: Mapping[str, torch.Tensor], name: str) -> _Projection:
    layer_config = _humming("humming.config").LayerConfig
    indexed = _humming("humming.config").GemmType.INDEXED
    get_heuristics_config = _humming("humming.tune").get_heuristics_config
    config_name = name + CONFIG_SUFFIX
    if config_name not in tensors or f"{name}_weight" not in tensors:
        raise KernelInputError(config_name, "missing: not a HUMMING writer's layer")
    try:
        config = layer_config(**config_from_tensor(tensors[config_name]))
    except (ValueError, TypeError, UnicodeDecodeError) as exc:
        raise KernelInputError(config_name, f"is not a humming LayerConfig: {exc}") from None
    weight = tensors[f"{name}_weight"]
    _require_cuda(weight)
    intervals = get_heuristics_config(
        layer_config=config,
        use_f16_accum=False,
        use_batch_invariant=False,
        gemm_type=indexed,
        device=weight.device,
    )
    return _Projection(
        config=config,
        weight=weight,
        weight_scale=tensors.get(f"{name}_weight_scale"),
        zero_point=tensors.get(f"{name}_zero_point"),
        bias=tensors.get(f"{name}_bias"),
        intervals=[(int(low), int(high), dict(tuning)) for low, high, tuning in intervals],
    )


def _require_cuda(weight: torch.Tensor) -> None:
    if not weight.is_cuda:
        raise KernelUnavailableError(BACKEND, "the layer's tensors must be on a CUDA GPU")


def _check_shapes(w13: _Projection, w2: _Projection, spec: LayerSpec) -> None:
    """The recorded configs must describe the layer the spec names (unpadded shapes)."""
    expected = {
        "w13": (w13, spec.w13_rows, spec.hidden_size),
        "w2": (w2, spec.hidden_size, spec.intermediate_size),
    }
    for name, (projection, n, k) in expected.items():
        config = projection.config
        got = (config.shape_n - config.pad_shape_n, config.shape_k - config.pad_shape_k)
        if got != (n, k):
            raise KernelInputError(
                name + CONFIG_SUFFIX, f"describes N, K = {got}, the layer needs {(n, k)}"
            )
        if config.num_experts != spec.num_experts:
            raise KernelInputError(
                name + CONFIG_SUFFIX,
                f"has {config.num_experts} experts, the layer {spec.num_experts}",
            )
