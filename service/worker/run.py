"""The worker's RunMoE job: one fused MoE forward on a kept layer or on inline weights.

Inputs arrive as segments the server filled (hidden states, router logits or top-k ids and
weights, inline weights); they are viewed as tensors without a copy, moved to the worker's
device, routed (vLLM's default top-k: softmax or sigmoid, top-k, optional renormalize),
run through the layer's prepared backend, and the output is written into the segment the
server lent for it (`out_segment`, `out_capacity` bytes; one of the server's pooled
segments), or into a new one (`out_spill`) when none was lent or it is too small. Nothing
crosses the pipe but names and numbers.

A backend is never substituted: the layer runs with the backend it was converted for, or
the one the request names if that backend reads the layer's layout; anything else is an
input error naming `backend`, and a backend that cannot run on this device is
`KernelUnavailableError`. Every input error is raised before a kernel is launched, so the
worker stays healthy.
"""

from __future__ import annotations

import functools
import os
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from service.formats.io.streaming import DTYPES, FROM_TORCH, TensorSpec
from service.formats.routes import inline
from service.ipc.messages import InlineWeights, MoeRan, RunMoE, SegmentTensor
from service.ipc.segments import Segment, SegmentDir
from service.kernels import registry
from service.kernels.activation import resolve
from service.kernels.errors import KernelInputError, KernelUnavailableError
from service.kernels.interface import ExpertsBackend, KernelOptions, LayerSpec, load_backend_class
from service.kernels.routing import as_route, check_given_route, topk_route
from service.settings import worker_setting
from service.worker.context import WorkerContext
from service.worker.errors import LayerMissingError
from service.worker.jobs import JobContext
from service.worker.layers import LoadedLayer
from service.worker.mapped import MappedSegments

# Inputs are views of read-only mappings (segments.MappedSegments): torch says once per
# process that it cannot mark a tensor read-only; the mapping itself enforces it.
warnings.filterwarnings("ignore", "The given buffer is not writable", UserWarning)

#: Most timed or warm-up iterations one call may ask for (each is a whole forward).
MAX_ITERATIONS = 1000
#: The options every backend this worker makes is given, read from the worker's settings
#: once (`service.settings.worker_setting`: triton_decode).
KERNEL_OPTIONS = KernelOptions(triton_decode=worker_setting("triton_decode", os.environ))


@functools.cache
def backend_class(backend: str, layout: str) -> type[ExpertsBackend]:
    """The class that runs `backend` on a layer in `layout` (imported once: every RunMoE
    asks); an error when it cannot read that layout."""
    path = registry.runner_for(backend, layout)
    if path is None:
        readers = sorted(row.name for row in registry.BACKENDS if layout in row.reads)
        raise KernelInputError(
            "backend",
            f"{backend or '(none)'} cannot run a layer in the {layout} layout; "
            f"backends that read it: {readers}",
        )
    return load_backend_class(path)


def kernel_status(device: torch.device) -> dict[str, dict[str, Any]]:
    """Each backend the worker has a runner for: whether it runs on `device`, and why not.

    The worker's `profile` answer carries this, so what the oracle may pick and what RunMoE
    would refuse (FAILED_PRECONDITION) can be compared before a request is sent. Checking
    MARLIN loads vLLM's ops library, so it is asked for, not done at start.
    """
    status: dict[str, dict[str, Any]] = {}
    for row in registry.BACKENDS:
        reason = backend_class(row.name, row.layout).unavailable_reason(device)
        status[row.name] = {"available": reason is None, "reason": reason or ""}
    return status


def kernel_names(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Tensors under the kernels' names (``w13_qweight``), without a checkpoint prefix."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        short = name.rsplit(".", 1)[-1]
        out[short] = tensor
    return out


def layer_spec(info: dict[str, Any], tensors: dict[str, torch.Tensor], gated: bool) -> LayerSpec:
    """The kernels' descriptor of a kept layer, from its LayerInfo and tensor names."""
    fmt = info.get("format") or {}
    return LayerSpec(
        num_experts=int(info["num_experts"]),
        hidden_size=int(info["hidden_size"]),
        intermediate_size=int(info["intermediate_size"]),
        bits=int(fmt.get("bits", 4)),
        group_size=int(fmt.get("group_size", -1)),
        has_zero_points=bool(fmt.get("has_zero_points", False)),
        has_bias=any(name.endswith("_bias") for name in tensors),
        gated=gated,
        act_order=any("g_idx" in name for name in tensors),
        layout=str(fmt.get("backend", "")),
    )


def prepared(layer: LoadedLayer, backend: str, device: torch.device) -> ExpertsBackend:
    """The layer's backend, prepared once (a different backend asked for is prepared on
    the spot and not kept: the layer's own one is what repeated calls use)."""
    layout = str(layer.info.get("format", {}).get("backend", ""))
    wanted = backend or layout
    cls = backend_class(wanted, layout)
    reason = cls.unavailable_reason(device)
    if reason is not None:
        raise KernelUnavailableError(wanted, reason)
    activation = resolve(str((layer.deployment.get("layer") or {}).get("activation", "silu")))

    def make(item: LoadedLayer) -> ExpertsBackend:
        tensors = kernel_names(item.tensors)
        runner = cls.configured(KERNEL_OPTIONS)
        runner.prepare(tensors, layer_spec(item.info, tensors, activation.gated))
        return runner

    if wanted == layout:
        runner: ExpertsBackend = layer.backend_for(make)
        return runner
    return make(layer)


def _tensor(view: memoryview, spec: TensorSpec) -> torch.Tensor:
    dtype = getattr(torch, DTYPES[spec.dtype].torch_name)
    if spec.byte_size == 0:
        return torch.empty(spec.shape, dtype=dtype)
    return torch.frombuffer(view, dtype=torch.uint8).view(dtype).reshape(spec.shape)


class _Timer:
    """Device time of a region: CUDA events on a GPU, the wall clock elsewhere.

    On a GPU the region's end is only recorded (`time` returns without waiting) and read
    by `seconds`, called once the output has come back: waiting for the output's copy
    waits for the forward too, so a call synchronises with the device once, not twice, and
    the host prepares the output's copy while the device still runs the forward."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self._events: tuple[torch.cuda.Event, torch.cuda.Event] | None = None
        self._seconds = 0.0
        self._iterations = 1

    def time(self, run: Callable[[], Any], iterations: int) -> None:
        if self.cuda:
            start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            start.record()
            for _ in range(iterations):
                run()
            end.record()
            self._events, self._iterations = (start, end), iterations
            return
        began = time.perf_counter()
        for _ in range(iterations):
            run()
        self._seconds = (time.perf_counter() - began) / iterations

    def seconds(self) -> float:
        """Seconds per iteration (on a GPU, waits for the region's end if need be)."""
        if self._events is not None:
            start, end = self._events
            end.synchronize()
            return float(start.elapsed_time(end)) / 1e3 / self._iterations
        return self._seconds


def _inline_layer(
    worker: WorkerContext, weights: InlineWeights, tensors: dict[str, torch.Tensor]
) -> LoadedLayer:
    """Convert inline weights on the fly, under the request's ruleset, into a LoadedLayer
    that is never stored."""
    shape = weights.shape
    result = inline.convert_layer(
        tensors,
        source=weights.source,
        backend=weights.backend,
        shape=inline.LayerShape(
            shape.num_experts, shape.hidden_size, shape.intermediate_size, shape.gated
        ),
        device=worker.device,
        keep_device=True,
        vllm_quantization=weights.quantization,
        ruleset=weights.ruleset,
    )
    descriptor = result.descriptor
    info = {
        "layer_id": "",
        "format": {
            "backend": weights.backend,
            "bits": int(descriptor.get("bits", 0)),
            "group_size": int(descriptor.get("group_size", 0)),
            "has_zero_points": bool(descriptor.get("has_zero_points", False)),
        },
        "num_experts": shape.num_experts,
        "hidden_size": shape.hidden_size,
        "intermediate_size": shape.intermediate_size,
    }
    return LoadedLayer("", info, dict(result.tensors), dict(weights.deployment))


def _route(
    host: dict[str, torch.Tensor],
    inputs: dict[str, torch.Tensor],
    layer: LoadedLayer,
    tokens: int,
    validate: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(topk_weights float32, topk_ids int32), from router logits or given top-k.

    What is read to be checked (finiteness, expert ids) is read from `host`, the segment
    views the inputs came in: on a GPU that is CPU work, not a synchronisation with the
    device; what is computed is computed from `inputs`: their copies on the device, or
    `host` itself where routing runs on the host (`_route_on_host`)."""
    num_experts = int(layer.info["num_experts"])
    conf = layer.deployment.get("layer") or {}
    routing = conf.get("routing") or {}
    logits = inputs.get("router_logits")
    if logits is not None:
        if logits.dim() != 2 or tuple(logits.shape) != (tokens, num_experts):
            raise KernelInputError(
                "router_logits",
                f"must be [{tokens}, {num_experts}] (tokens, experts), got {list(logits.shape)}",
            )
        checked = host["router_logits"]
        if validate and checked.dtype.is_floating_point and not bool(checked.isfinite().all()):
            raise KernelInputError("router_logits", "contains NaN or Inf")
        return topk_route(
            logits,
            int(conf.get("top_k", 2)),
            renormalize=bool(routing.get("renormalize", True)),
            scoring_func=str(routing.get("scoring_func", "softmax")),
        )
    ids, weights = inputs.get("topk.topk_ids"), inputs.get("topk.topk_weights")
    if ids is None or weights is None:
        raise KernelInputError("routing", "required: router_logits or topk (ids and weights)")
    if ids.dim() != 2 or ids.shape[0] != tokens:
        raise KernelInputError("topk.topk_ids", f"must be [{tokens}, k], got {list(ids.shape)}")
    host_weights = host["topk.topk_weights"]
    if (
        validate
        and host_weights.dtype.is_floating_point
        and not bool(host_weights.isfinite().all())
    ):
        raise KernelInputError("topk.topk_weights", "contains NaN or Inf")
    try:
        check_given_route(host["topk.topk_ids"], host_weights, num_experts)
    except KernelInputError as exc:
        raise KernelInputError(f"topk.{exc.field}", exc.description) from None
    return as_route(ids, weights)


#: Most router scores (tokens x experts) a CUDA worker routes on the host, before the copy.
#: Routing is ~7 small ops; on the device each is a kernel launch (~0.03-0.04 ms of host
#: time apiece on the H200 host: 0.365 ms for routing at M = 1), on the host a few µs of
#: CPU for a few thousand scores, and its result rides in the inputs' one packed copy.
#: Beyond this the device's parallel sort wins. Same function either way (topk_route):
#: float32 softmax/sigmoid, stable descending sort, renormalize.
HOST_ROUTING_MAX_SCORES = 8192


def _route_on_host(inputs: dict[str, torch.Tensor]) -> bool:
    """Whether to route from the host copies before the copy to the device (on a CPU worker
    both ways compute on the same tensors: the inputs are used in place)."""
    logits = inputs.get("router_logits")
    scores = logits if logits is not None else inputs.get("topk.topk_ids")
    return scores is not None and scores.numel() <= HOST_ROUTING_MAX_SCORES


@functools.lru_cache(maxsize=8)
def _segment_dir(path: str) -> SegmentDir:
    """The server's segment directory (the same few on every call: made once)."""
    return SegmentDir(Path(path))


@functools.lru_cache(maxsize=8)
def _mapped(path: str) -> MappedSegments:
    """The mappings of that directory's segments kept between calls (inputs and the lent
    output: the server's pooled segments, the same files call after call)."""
    return MappedSegments(_segment_dir(path))


class _Stages:
    """Host wall-clock seconds per stage of one run_moe call, in order: what the worker's
    thread spends where, returned in the answer as `stages` (bench/worker_call_overhead.py
    prints them; the server may ignore them). No synchronisation is added: on a GPU the
    copies (and routing, where it runs on the device) only launch work, which the forward's
    end event waits for, so their device time shows up under "forward" and theirs is the
    launch cost alone."""

    #: Every call reports these, in this order (routing runs before or after the copy to
    #: the device depending on where it runs); "compare" and "output" follow.
    ORDER = ("open", "layer", "routing", "to_device", "forward")

    def __init__(self) -> None:
        self.seconds: dict[str, float] = dict.fromkeys(self.ORDER, 0.0)
        self._last = time.perf_counter()

    def done(self, stage: str) -> None:
        now = time.perf_counter()
        self.seconds[stage] = self.seconds.get(stage, 0.0) + now - self._last
        self._last = now


def run_moe(worker: WorkerContext, request: RunMoE, context: JobContext) -> MoeRan:
    stages = _Stages()
    segments = _segment_dir(request.segments_dir)
    mapped = _mapped(request.segments_dir)
    opened: list[Segment] = []
    device = torch.device(worker.device)
    try:

        def load(items: tuple[SegmentTensor, ...]) -> dict[str, torch.Tensor]:
            """Inline weights: big, one call's, mapped for this call only."""
            out: dict[str, torch.Tensor] = {}
            for item in items:
                segment = segments.open(item.segment, item.spec.byte_size)
                opened.append(segment)
                out[item.spec.name] = _tensor(segment.view, item.spec)
            return out

        inputs: dict[str, torch.Tensor] = {}
        for item in request.inputs:
            spec = item.spec
            inputs[spec.name] = _tensor(mapped.read(item.segment, spec.byte_size), spec)
        stages.done("open")
        if request.layer_id is not None:
            layer = worker.layers.use(request.layer_id)
            if layer is None:
                raise LayerMissingError(request.layer_id)
        elif request.inline is not None:
            layer = _inline_layer(worker, request.inline, load(request.inline.tensors))
        else:
            raise KernelInputError("weights", "required: layer_id or inline")
        context.check()
        validate = request.validate
        hidden = inputs["hidden_states"]
        if hidden.dim() != 2:
            raise KernelInputError(
                "hidden_states", f"must be 2-D [tokens, hidden], got {list(hidden.shape)}"
            )
        if validate and hidden.dtype.is_floating_point and not bool(hidden.isfinite().all()):
            raise KernelInputError("hidden_states", "contains NaN or Inf")
        runner = prepared(layer, request.backend, device)
        stages.done("layer")
        tokens = int(hidden.shape[0])
        if _route_on_host(inputs):
            weights, ids = _route(inputs, inputs, layer, tokens, validate)
            stages.done("routing")
            sent = {"hidden_states": hidden, "weights": weights, "ids": ids}
            on_device = worker.transport.to_device_all(sent)
            weights, ids = on_device["weights"], on_device["ids"]
            stages.done("to_device")
        else:
            on_device = worker.transport.to_device_all(inputs)
            stages.done("to_device")
            weights, ids = _route(inputs, on_device, layer, tokens, validate)
            stages.done("routing")
        hidden = on_device["hidden_states"]
        activation = str((layer.deployment.get("layer") or {}).get("activation", "silu"))
        warmup = min(request.warmup, MAX_ITERATIONS)
        timed = max(1, min(request.timed, MAX_ITERATIONS))
        # Checked before every forward: up to 2000 of them may follow a caller that has
        # gone (deadline, cancel), and the worker must not compute for it for minutes.
        for _ in range(warmup):
            context.check()
            runner.forward(hidden, ids, weights, activation, validate=validate)
        results: list[torch.Tensor] = []

        def once() -> None:
            context.check()
            results[:] = [runner.forward(hidden, ids, weights, activation, validate=validate)]

        # The output is the last timed iteration's: no extra untimed forward (under the
        # Triton interpreter on CPU each one costs seconds).
        timer = _Timer(device)
        timer.time(once, timed)
        out = results[0]
        stages.done("forward")
        max_abs_error = None
        if request.compare:
            reference = _reference(layer, hidden, ids, weights, activation)
            diff = (out.to(torch.float32) - reference).abs()
            max_abs_error = float(diff.max()) if diff.numel() else 0.0
            stages.done("compare")
        # Described first: on a GPU this host work overlaps the forward's end (_Timer).
        described = TensorSpec.of(
            "output", FROM_TORCH[str(out.dtype).removeprefix("torch.")], tuple(out.shape)
        )
        name, nbytes = request.out_segment, out.numel() * out.element_size()
        capacity = request.out_capacity
        if capacity is None or nbytes > capacity:
            # No segment lent for the output (or it is too small): a new one of our own.
            name = request.out_spill or name
            with segments.new(name, nbytes) as segment:
                worker.transport.to_host(out, segment.view)
        else:
            lent = name
            worker.transport.to_file(out, lambda data: mapped.write(lent, data))
        # After the output: its copy back has waited for the forward already (_Timer).
        device_seconds = timer.seconds()
        stages.done("output")
        return MoeRan(
            backend=runner.name,
            tokens=tokens,
            output=SegmentTensor(described, name),
            device_seconds=device_seconds,
            max_abs_error=max_abs_error,
            stages=stages.seconds,
        )
    finally:
        for segment in opened:
            segment.close()


def _reference(
    layer: LoadedLayer,
    hidden: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    activation: str,
) -> torch.Tensor:
    """The float32 EMULATION forward on the same layer (its own layout's reader)."""
    layout = str(layer.info.get("format", {}).get("backend", ""))
    runner = prepared(layer, "EMULATION", hidden.device)
    if layout == "EMULATION":
        dense: torch.Tensor = runner.forward_fp32_checked(  # type: ignore[attr-defined]
            hidden, ids, weights, resolve(activation)
        )
        return dense
    result: torch.Tensor = runner.forward_fp32(hidden, ids, weights, activation)  # type: ignore[attr-defined]
    return result
