"""The worker's `measure_backends` job: time each backend it runs on one layer shape.

SelectBackend's measured policy asks this of the serving worker. For every backend named,
the same synthetic layer (random codes, scales and zero points of the deployment's
quantization: `service.formats.synthetic`) is written into that backend's layout by the
service's own writer, prepared by the class that RunMoE would run it with, and timed at
each token count: fresh hidden states and router logits, vLLM's softmax top-k routing, a
warm-up forward, then forwards until a small time budget is spent (at least `MIN_RUNS`),
the median reported. Device time is measured like RunMoE's: CUDA events on a GPU, the wall
clock elsewhere.

A backend that cannot run here (no CUDA, no humming, no Marlin library) or cannot take the
layer (a writer or kernel that refuses its quantization) is reported with the reason and
costs nothing. Nothing is kept: the layers are dropped when the job ends.
"""

from __future__ import annotations

import importlib.metadata
import logging
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from service import __version__
from service.formats import registry
from service.formats.errors import ConversionUnsupported
from service.formats.routes.spec import SourceSpec
from service.formats.synthetic.checkpoints import SyntheticSpec, synthetic_layer, to_device
from service.formats.writers import ConversionOptions
from service.ipc.messages import BackendsMeasured, BackendTiming, MeasureBackends
from service.kernels.errors import KernelError, KernelInputError
from service.kernels.interface import ExpertsBackend, LayerSpec
from service.kernels.routing import topk_route
from service.worker.context import WorkerContext
from service.worker.jobs import JobContext
from service.worker.run import KERNEL_OPTIONS, backend_class, kernel_names

log = logging.getLogger("moe_control.worker.measure")

#: Fewest timed forwards per (backend, token count), and the time budget that adds more.
MIN_RUNS = 3
MAX_RUNS = 200
DEFAULT_BUDGET_S = 0.2
#: Zeroed before each timed GPU run: larger than the L2, so weights come from HBM.
FLUSH_BYTES = 256 * 1024 * 1024
#: Limits one request may ask for (each is checked before anything is built).
MAX_TOKENS = 16384
MAX_BUCKETS = 16
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}


def versions() -> dict[str, str]:
    """What the timings depend on besides the device: the cache key's version part."""
    found = {"moe-control": __version__, "torch": torch.__version__}
    for package in ("triton", "humming-kernels"):
        try:
            found[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            continue
    return found


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return str(torch.cuda.get_device_name(device))
    return device.type


def _checked(request: MeasureBackends) -> tuple[dict[str, Any], list[int]]:
    """The request's shape and token counts, checked (KernelInputError naming the field)."""
    shape = dict(request.shape)
    for name in ("num_experts", "top_k", "hidden_size", "intermediate_size"):
        value = shape.get(name, 0)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise KernelInputError(f"shape.{name}", "must be a positive integer")
    tokens = list(request.token_counts)
    if not tokens or len(tokens) > MAX_BUCKETS or not all(1 <= t <= MAX_TOKENS for t in tokens):
        raise KernelInputError(
            "token_counts", f"1 to {MAX_BUCKETS} counts, each in 1..{MAX_TOKENS}, got {tokens}"
        )
    return shape, tokens


def measure_backends(
    worker: WorkerContext, request: MeasureBackends, context: JobContext
) -> BackendsMeasured:
    """Each backend's median seconds per forward at each token count, or why it could not
    be timed here."""
    shape, tokens = _checked(request)
    source, backends = request.source, request.backends
    device = torch.device(worker.device)
    dtype = DTYPES.get(str(shape.get("dtype") or "bfloat16"), torch.bfloat16)
    budget_s = DEFAULT_BUDGET_S if request.budget_s is None else request.budget_s
    seed = request.seed
    spec = SyntheticSpec(
        layout=source.layout,
        num_experts=int(shape["num_experts"]),
        top_k=int(shape["top_k"]),
        hidden_size=int(shape["hidden_size"]),
        intermediate_size=int(shape["intermediate_size"]),
        bits=source.bits,
        group_size=source.group_size,
        symmetric=source.symmetric,
        desc_act=source.desc_act,
        seed=seed,
        fast=True,
        dtype=dtype,
    )
    layer = synthetic_layer(spec, torch.Generator().manual_seed(seed))
    layer = to_device(layer, device) if device.type != "cpu" else layer
    activation = str(shape.get("activation") or "silu")
    results: list[BackendTiming] = []
    for backend in backends:
        context.check()
        seconds: dict[str, float] = {}
        try:
            runner = _prepared(
                backend, layer, source=source, spec=spec, device=device, tokens=tokens
            )
        except (ConversionUnsupported, KernelError) as exc:
            results.append(BackendTiming(backend, error=str(exc)[:300]))
            continue
        generator = torch.Generator(device=device).manual_seed(seed + 1)
        for count in tokens:
            context.check()
            x = torch.randn((count, spec.hidden_size), generator=generator, device=device)
            logits = torch.randn((count, spec.num_experts), generator=generator, device=device)
            weights, ids = topk_route(logits, spec.top_k)
            hidden = x.to(dtype)

            def once(
                r: ExpertsBackend = runner,
                args: tuple[torch.Tensor, torch.Tensor, torch.Tensor] = (hidden, ids, weights),
            ) -> None:
                r.forward(args[0], args[1], args[2], activation)

            seconds[str(count)] = median_seconds(
                once, device, budget_s, capturable=runner.graph_capturable
            )
        del runner
        results.append(BackendTiming(backend, seconds))
    return BackendsMeasured(device_name(device), versions(), tuple(results))


def _prepared(
    backend: str,
    layer: Any,
    *,
    source: SourceSpec,
    spec: SyntheticSpec,
    device: torch.device,
    tokens: list[int],
) -> ExpertsBackend:
    """The backend's runner on `layer` written in its layout (errors say why it cannot)."""
    try:
        cls = backend_class(backend, backend)
    except KernelInputError as exc:
        raise ConversionUnsupported(backend, "this worker has no kernel for it") from exc
    reason = cls.unavailable_reason(device)
    if reason is not None:
        raise ConversionUnsupported(backend, f"unavailable on {device}: {reason}")
    options = ConversionOptions(device=device, activation_dtype=spec.dtype)
    converted = registry.convert(layer, backend, source=source.layout, options=options)
    tensors = kernel_names(converted.tensors)
    runner = cls.configured(KERNEL_OPTIONS)
    runner.prepare(
        tensors,
        LayerSpec(
            num_experts=spec.num_experts,
            hidden_size=spec.hidden_size,
            intermediate_size=spec.intermediate_size,
            bits=spec.bits,
            group_size=spec.group_size,
            has_zero_points=not spec.symmetric,
            act_order=layer.w13.g_idx is not None,
            layout=backend,
        ),
    )
    warm = getattr(runner, "warm_up", None)
    if warm is not None:  # humming: compile every token count's kernels at once
        warm(tokens, spec.top_k)
    return runner


def median_seconds(
    run: Callable[[], None], device: torch.device, budget_s: float, *, capturable: bool = True
) -> float:
    """Median seconds of `run` after one warm-up: at least MIN_RUNS, more while under budget.

    On a GPU the forward is captured in a CUDA graph and its replays are timed with CUDA
    events, a 256 MiB buffer zeroed before each (outside the events) so the weights come
    from HBM, as bench/moe_bench.py times them: a ranking of kernels, not of Python launch
    overhead. A backend that says it cannot be captured (`graph_capturable`) is timed on
    plain launches; so is one whose capture fails all the same. Elsewhere the
    wall clock of each run."""
    run()
    if device.type != "cuda":
        return _median(run, budget_s, lambda: None, time.perf_counter, lambda a, b: b - a)
    replay = (_graphed(run, device) if capturable else None) or run
    flush = torch.empty(FLUSH_BYTES, dtype=torch.uint8, device=device)

    def mark() -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        event.record()
        return event

    def elapsed(start: torch.cuda.Event, end: torch.cuda.Event) -> float:
        end.synchronize()
        return float(start.elapsed_time(end)) / 1e3

    return _median(replay, budget_s, flush.zero_, mark, elapsed)


def _median(
    run: Callable[[], Any],
    budget_s: float,
    before: Callable[[], Any],
    mark: Callable[[], Any],
    elapsed: Callable[[Any, Any], float],
) -> float:
    times: list[float] = []
    began = time.perf_counter()
    while len(times) < MIN_RUNS or (
        len(times) < MAX_RUNS and time.perf_counter() - began < budget_s
    ):
        before()
        start = mark()
        run()
        times.append(elapsed(start, mark()))
    return float(statistics.median(times))


def _graphed(run: Callable[[], None], device: torch.device) -> Callable[[], None] | None:
    """`run` captured in a CUDA graph (its replay), or None when it cannot be captured."""
    try:
        stream = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            run()
        torch.cuda.current_stream(device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            run()
    except Exception as exc:  # a host synchronisation inside: time plain launches
        torch.cuda.synchronize(device)
        log.info("forward not captured in a CUDA graph: %s", exc)
        return None
    replay: Callable[[], None] = graph.replay
    return replay
