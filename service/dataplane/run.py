"""RunMoE's use case: check the request, hand its tensors to a worker through segments,
give the worker's answer back while its output is still in its segment.

Everything that can be judged without the layer is judged here, before a byte is copied:
the hidden states' dtype and rank, the token count against `run_max_tokens`
(RESOURCE_EXHAUSTED naming `hidden_states`), the answer's size against
`max_send_message_bytes`, inline weights against `run_max_inline_bytes`,
every tensor's data length against its dtype and shape. What needs the layer (hidden size,
expert count, routing shapes, NaN/Inf with `validate_inputs`) is judged by the worker before
it launches anything; its error answers come back as the same domain errors. Tensors cross
to the worker as files in the server's private segment directory (/dev/shm when it has
room), never through the pipe: pooled segments (segments.SegmentPool), kept mapped and
reused by size class, since a fresh file per tensor per call cost more than the rest of
the server's work (bench/RESULTS.md). The output's segment is lent with the inputs'. When
the worker has answered they go back to the pool; a call that ends otherwise (cancelled,
deadline, the worker gone) deletes them, as the worker may still map them. An idle pool
deletes its files after `POOL_IDLE_S`.

The answer (`RunResult`) holds a view of the output's segment, valid only inside the
caller's `encode` callback: the caller encodes the reply there (the gRPC edge writes the
response bytes straight from the segment) and gets back what `encode` returned.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from service.dataplane.errors import RunInputError, RunResourceError, run_error
from service.formats.errors import ConvertResourceError
from service.formats.io.streaming import DTYPES, TensorSpec
from service.formats.routes.spec import resolve_target, source_spec
from service.ipc.errors import SegmentError
from service.ipc.messages import InlineWeights, LayerShape, MoeRan, RunMoE, SegmentTensor
from service.ipc.segments import SegmentDir
from service.metrics import Metrics
from service.oracle import parse_deployment
from service.pool.errors import WorkerCallError
from service.pool.handle import WorkerHandle
from service.pool.pool import WorkerPool
from service.pool.segments import Pooled, SegmentPool
from service.settings import MIB, Settings

HIDDEN_DTYPES = ("bfloat16", "float16")
#: Most warm-up or timed iterations one call may ask for.
MAX_ITERATIONS = 1000
#: Room in a RunMoE reply for everything but the output tensor's bytes (backend, shapes,
#: timings, error figures: well under a kilobyte today).
REPLY_ALLOWANCE = 4096
_R = TypeVar("_R")


@dataclass(frozen=True, slots=True)
class WireTensor:
    """A whole tensor as a request carries it: its name, its dtype's wire name ("" when
    unspecified or unknown; `dtype_code` is the value the request sent), shape and data."""

    name: str
    dtype: str
    dtype_code: int
    shape: tuple[int, ...]
    data: bytes


@dataclass(frozen=True, slots=True)
class InlineLayer:
    """Weights sent with the call: the layer's deployment spec (converted when it is
    judged, after the checks that need no spec) and its checkpoint tensors."""

    spec: Callable[[], dict[str, Any]]
    tensors: tuple[WireTensor, ...]


@dataclass(frozen=True, slots=True)
class RunRequest:
    """One RunMoE call. `weights` says which weights it names: "layer_id" (a kept layer,
    `layer_id`), "inline_layer" (`inline_layer`) or None; the routing is `router_logits`,
    else `topk` (ids, weights), else missing."""

    hidden_states: WireTensor | None
    weights: str | None
    layer_id: str = ""
    inline_layer: InlineLayer | None = None
    router_logits: WireTensor | None = None
    topk: tuple[WireTensor, WireTensor] | None = None
    worker_index: int | None = None
    backend: str = ""
    validate_inputs: bool = False
    warmup_iterations: int = 0
    timed_iterations: int = 0
    compare_with_reference: bool = False
    #: The rule set inline weights convert by ("": the spec's, else the newest).
    ruleset: str = ""


@dataclass(frozen=True, slots=True)
class RunResult:
    """A run's answer. `data` is a view of the output's segment, valid only inside the
    `encode` callback it is passed to."""

    backend: str
    worker_index: int
    device_seconds: float
    max_abs_error: float | None
    #: The output's dtype (the hidden states') and shape [tokens, hidden].
    dtype: str
    shape: list[int]
    data: memoryview


def wire_tensor(tensor: WireTensor, field: str, name: str = "") -> TensorSpec:
    """The declaration of a whole tensor, checked against its data length; named `name`,
    else by its request field (what the worker looks inputs up by)."""
    dtype = tensor.dtype
    if dtype not in DTYPES:
        raise RunInputError(f"{field}.dtype", f"unknown or unspecified dtype ({tensor.dtype_code})")
    shape = list(tensor.shape)
    if shape and min(shape) < 0:
        raise RunInputError(f"{field}.shape", f"negative dimension in {shape}")
    spec = TensorSpec.of(name or field, dtype, shape)
    size = len(tensor.data)
    if spec.byte_size != size:
        raise RunInputError(
            f"{field}.data",
            f"{size} bytes, but {dtype} {shape} holds {spec.byte_size}",
        )
    return spec


class Runner:
    """One per server; `run` serves one RunMoE call."""

    def __init__(
        self,
        workers: WorkerPool,
        metrics: Metrics,
        settings: Settings,
        segments: Callable[[], SegmentDir],
    ) -> None:
        self._workers = workers
        self._metrics = metrics
        self._settings = settings
        self._segments = segments
        self._calls = itertools.count(1)
        # Calls' file-name prefixes: a counter and this runner's token (drawn once, not
        # per call: the counter already tells this runner's calls apart).
        self._token = secrets.token_hex(3)
        self._pool: SegmentPool | None = None
        self._trim_timer: tuple[asyncio.TimerHandle, asyncio.AbstractEventLoop] | None = None

    async def run(self, request: RunRequest, encode: Callable[[RunResult], _R]) -> _R:
        """Run the call; returns `encode(result)`, called while the output is lent."""
        self._check_hidden(request)
        assert request.hidden_states is not None
        which = request.weights
        if which is None:
            raise RunInputError("weights", "required: layer_id or inline_layer")
        named: list[tuple[str, WireTensor]] = [("hidden_states", request.hidden_states)]
        if request.router_logits is not None:
            named.append(("router_logits", request.router_logits))
        elif request.topk is not None:
            named.append(("topk.topk_ids", request.topk[0]))
            named.append(("topk.topk_weights", request.topk[1]))
        else:
            raise RunInputError("routing", "required: router_logits or topk")
        for field in ("warmup_iterations", "timed_iterations"):
            if getattr(request, field) > MAX_ITERATIONS:
                raise RunInputError(field, f"at most {MAX_ITERATIONS} (each is a whole forward)")
        specs = [(field, wire_tensor(tensor, field), tensor.data) for field, tensor in named]
        backend = request.backend.strip().upper()
        inline: InlineWeights | None = None
        inline_tensors: list[tuple[str, TensorSpec, bytes]] = []
        if which == "layer_id":
            if not request.layer_id:
                raise RunInputError("layer_id", "required: the id ConvertWeights returned")
            worker = await self._holder(request)
        else:
            assert request.inline_layer is not None
            worker = self._workers.place(request.worker_index)
            inline, inline_tensors = self._inline(
                request.inline_layer, worker.index, backend, request.ruleset
            )
        segments = self._segments()
        pool = self._pool_of(segments)
        prefix = f"r{next(self._calls)}-{self._token}-"
        lent: list[Pooled] = []
        answered = spilled = False
        try:
            inputs = tuple(self._put(pool, lent, s, d) for _, s, d in specs)
            if inline is not None:
                put = tuple(self._put(pool, lent, s, d) for _, s, d in inline_tensors)
                inline = dataclasses.replace(inline, tensors=put)
            # The output is [tokens, hidden] in the hidden states' dtype: its pooled segment
            # is lent up front; a worker whose output does not fit writes a new one instead.
            out_segment = self._take(pool, lent, len(specs[0][2]))
            call = RunMoE(
                segments_dir=str(segments.path),
                inputs=inputs,
                out_segment=out_segment.name,
                out_capacity=out_segment.capacity,
                out_spill=f"{prefix}out",
                layer_id=request.layer_id if which == "layer_id" else None,
                inline=inline,
                backend=backend,
                validate=request.validate_inputs,
                warmup=request.warmup_iterations,
                timed=request.timed_iterations or 1,
                compare=request.compare_with_reference,
            )
            try:
                answer = await worker.call(
                    call, on_abandon=lambda late: _discard(segments.remove(prefix))
                )
            except WorkerCallError as exc:
                answered = True
                raise run_error(exc, request.layer_id) from None
            answered = True
            described = answer.output.spec
            shape = list(described.shape)
            nbytes = described.byte_size
            spilled = answer.output.segment != out_segment.name
            dtype = request.hidden_states.dtype
            # The reply is encoded while the output's segment is still lent to this call.
            if not spilled:
                view = out_segment.view(nbytes)
                result = encode(_result(answer, worker.index, dtype, shape, view))
            else:
                with segments.open(answer.output.segment, nbytes) as segment:
                    result = encode(_result(answer, worker.index, dtype, shape, segment.view))
        finally:
            # Once the worker has answered it maps none of them; otherwise (cancelled, the
            # worker gone) it may still: their files go, its mappings stay valid.
            (pool.give if answered else pool.drop)(lent)
            self._schedule_trim(pool)
            if spilled or not answered:
                segments.remove(prefix)  # the worker's own output segment, if it made one
        seconds, tokens = self._metrics.run_moe_children(answer.backend)
        seconds.observe(answer.device_seconds)
        tokens.inc(answer.tokens)
        return result

    def _check_hidden(self, request: RunRequest) -> tuple[int, int]:
        tensor = request.hidden_states
        if tensor is None:
            raise RunInputError("hidden_states", "required: [tokens, hidden_size] bf16 or fp16")
        dtype = tensor.dtype
        if dtype not in HIDDEN_DTYPES:
            raise RunInputError(
                "hidden_states.dtype", f"must be bfloat16 or float16, got {dtype or 'unspecified'}"
            )
        shape = list(tensor.shape)
        if len(shape) != 2:
            raise RunInputError(
                "hidden_states.shape", f"must be [tokens, hidden_size], got {shape}"
            )
        tokens = int(shape[0])
        limit = self._settings.run_max_tokens
        if tokens > limit:
            raise RunResourceError(
                "hidden_states.shape[0]",
                f"{tokens} tokens exceed this server's limit of {limit} (setting run_max_tokens)",
                "run_max_tokens",
            )
        # The answer carries [tokens, hidden] in the same dtype. One larger than the send
        # limit would be refused by grpc's core only after the forward ran, as an error-level
        # log line and a bare "Sent message larger than max": refuse it here, before any work.
        answer = tokens * int(shape[1]) * DTYPES[dtype].itemsize + REPLY_ALLOWANCE
        send_limit = self._settings.max_send_message_bytes
        if answer > send_limit:
            raise RunResourceError(
                "hidden_states.shape",
                f"the answer for {tokens} tokens of {shape[1]} would take {answer} bytes, over "
                f"this server's limit of {send_limit} (setting max_send_message_bytes); "
                "send fewer tokens per call",
                "max_send_message_bytes",
            )
        return tokens, int(shape[1])

    async def _holder(self, request: RunRequest) -> WorkerHandle:
        """The worker that holds the layer: the named one, else the one the pool's layer
        directory maps it to (a layer lost in its worker's restart says so)."""
        if request.worker_index is not None:
            return self._workers.worker(request.worker_index)
        return await self._workers.holder(request.layer_id)

    def _inline(
        self, layer: InlineLayer, index: int, backend: str, ruleset: str
    ) -> tuple[InlineWeights, list[tuple[str, TensorSpec, bytes]]]:
        """What the worker needs to convert inline weights on the fly (their segments are
        filled in once lent), and their tensors."""
        if not layer.tensors:
            raise RunInputError("inline_layer.tensors", "required: the layer's checkpoint tensors")
        total = sum(len(tensor.data) for tensor in layer.tensors)
        limit = self._settings.run_max_inline_bytes
        if total > limit:
            raise RunResourceError(
                "inline_layer.tensors",
                f"{total} bytes of inline weights exceed {limit} ({limit // MIB} MiB, setting "
                "run_max_inline_bytes); convert with keep_loaded and run by layer_id",
                "run_max_inline_bytes",
            )
        spec = layer.spec()
        spec["platform"] = None
        deployment = parse_deployment(spec, default_platform=self._workers.profile(index))
        source = source_spec(
            deployment.hf_quantization_config, quantization=deployment.quantization
        )
        target = resolve_target(deployment, backend, ruleset=ruleset, field="backend")
        tensors = []
        for number, tensor in enumerate(layer.tensors):
            field = f"inline_layer.tensors[{tensor.name or number}]"
            tensors.append((field, wire_tensor(tensor, field, tensor.name), tensor.data))
        shape = deployment.layer
        weights = InlineWeights(
            tensors=(),
            source=source,
            backend=target.backend,
            ruleset=target.ruleset,
            shape=LayerShape(
                shape.num_experts, shape.hidden_size, shape.intermediate_size, shape.is_gated
            ),
            quantization=deployment.quantization,
            deployment=deployment.to_json(),
        )
        return weights, tensors

    def _pool_of(self, segments: SegmentDir) -> SegmentPool:
        if self._pool is None or self._pool.directory is not segments:
            self._pool = SegmentPool(segments)
        return self._pool

    def _schedule_trim(self, pool: SegmentPool) -> None:
        """Delete idle pooled segments once they have been idle `idle_s` (one timer)."""
        loop = asyncio.get_running_loop()
        pending = self._trim_timer
        if not pool.idle_bytes or (pending is not None and pending[1] is loop):
            return

        def trim() -> None:
            self._trim_timer = None
            if pool.trim():
                self._schedule_trim(pool)

        self._trim_timer = (loop.call_later(pool.idle_s, trim), loop)

    @staticmethod
    def _take(pool: SegmentPool, lent: list[Pooled], nbytes: int) -> Pooled:
        try:
            item = pool.take(nbytes)
        except SegmentError as exc:
            raise ConvertResourceError(str(exc)) from None
        lent.append(item)
        return item

    def _put(
        self, pool: SegmentPool, lent: list[Pooled], spec: TensorSpec, data: bytes
    ) -> SegmentTensor:
        item = self._take(pool, lent, len(data))
        if data:
            item.view(len(data))[:] = data
        return SegmentTensor(spec, item.name)


def _result(
    answer: MoeRan, worker_index: int, dtype: str, shape: list[int], data: memoryview
) -> RunResult:
    return RunResult(
        backend=answer.backend,
        worker_index=worker_index,
        device_seconds=answer.device_seconds,
        max_abs_error=answer.max_abs_error,
        dtype=dtype,
        shape=shape,
        data=data,
    )


def _discard(value: object) -> None:
    """For callbacks that must return None."""
