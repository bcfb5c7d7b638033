"""RunMoE, the server side: check the request, hand its tensors to a worker through
segments, turn the worker's answer into the response.

Everything that can be judged without the layer is judged here, before a byte is copied:
the hidden states' dtype and rank, the token count against `run_max_tokens`
(RESOURCE_EXHAUSTED naming `hidden_states`), inline weights against `run_max_inline_bytes`,
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
"""

from __future__ import annotations

import asyncio
import itertools
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from service.api import codec, convert_codec
from service.api.generated.moe_control.v1 import moe_control_service_pb2 as pb
from service.api.generated.moe_control.v1 import tensor_pb2
from service.formats.errors import ConvertResourceError
from service.formats.io.streaming import DTYPES, TensorSpec
from service.formats.routes.spec import resolve_target, source_spec
from service.ipc.errors import SegmentError
from service.ipc.segments import SegmentDir
from service.metrics import Metrics
from service.oracle import parse_deployment
from service.pool.errors import (
    BackendUnavailableError,
    LayerNotFoundError,
    RunInputError,
    RunResourceError,
    WorkerCallError,
)
from service.pool.handle import WorkerHandle
from service.pool.pool import WorkerPool
from service.pool.segments import Pooled, SegmentPool
from service.settings import MIB, Settings

HIDDEN_DTYPES = ("bfloat16", "float16")
#: Wire dtype enum value -> name, as `convert_codec.dtype_name` gives it ("" for
#: unspecified), built once: the enum's `Name()` is a Python call per lookup.
_DTYPE_NAMES = {value: convert_codec.dtype_name(value) for value in tensor_pb2.Dtype.values()}
#: Most warm-up or timed iterations one call may ask for.
MAX_ITERATIONS = 1000
_R = TypeVar("_R")


def wire_tensor(
    message: tensor_pb2.Tensor, field: str, name: str = "", data: bytes | None = None
) -> TensorSpec:
    """The declaration of a whole-tensor message, checked against its data length; named
    `name`, else by its request field (what the worker looks inputs up by). `data` is the
    message's data when the caller has it already: each read of a bytes field copies it."""
    dtype = _DTYPE_NAMES.get(message.dtype, "")
    if dtype not in DTYPES:
        raise RunInputError(f"{field}.dtype", f"unknown or unspecified dtype ({message.dtype})")
    shape = list(message.shape)  # one read: each builds the repeated field's wrapper anew
    if shape and min(shape) < 0:
        raise RunInputError(f"{field}.shape", f"negative dimension in {shape}")
    spec = TensorSpec.of(name or field, dtype, shape)
    size = len(message.data if data is None else data)
    if spec.byte_size != size:
        raise RunInputError(
            f"{field}.data",
            f"{size} bytes, but {dtype} {shape} holds {spec.byte_size}",
        )
    return spec


def from_worker(exc: WorkerCallError, layer_id: str = "") -> Exception:
    """The domain error a worker's error answer stands for."""
    details = exc.details
    category = details.get("category")
    field = str(details.get("field", ""))
    description = str(details.get("description") or exc.message)
    if category == "invalid_argument":
        return RunInputError(field or "request", description)
    if category == "not_found":
        return LayerNotFoundError(layer_id)
    if category == "resource_exhausted":
        return RunResourceError(field or "request", description)
    if category == "backend_unavailable":
        return BackendUnavailableError(exc.message.split(":", 1)[0], description)
    if category == "unimplemented":
        return NotImplementedError(exc.message)
    return exc


class RunMoEHandler:
    """One per server; `__call__` serves one RunMoE call."""

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
        # Calls' file-name prefixes: a counter and this handler's token (drawn once, not
        # per call: the counter already tells this handler's calls apart).
        self._token = secrets.token_hex(3)
        self._pool: SegmentPool | None = None
        self._trim_timer: tuple[asyncio.TimerHandle, asyncio.AbstractEventLoop] | None = None

    async def __call__(self, request: pb.RunMoERequest) -> pb.RunMoEResponse:
        """The reply as a message (what the generated classes build; the bytes path's
        reference)."""
        return await self._serve(request, _reply_message)

    async def answer_bytes(self, request: pb.RunMoERequest) -> bytes:
        """The reply's serialized bytes, written straight from the output segment: one copy
        of the output instead of three (segment -> bytes -> message -> serialized)."""
        return await self._serve(request, reply_bytes)

    async def _serve(self, request: pb.RunMoERequest, reply: Callable[[Reply], _R]) -> _R:
        hidden = self._check_hidden(request)
        which = request.WhichOneof("weights")
        if which is None:
            raise RunInputError("weights", "required: layer_id or inline_layer")
        named: list[tuple[str, tensor_pb2.Tensor]] = [("hidden_states", request.hidden_states)]
        routing = request.WhichOneof("routing")
        if routing == "router_logits":
            named.append(("router_logits", request.router_logits))
        elif routing == "topk":
            named.append(("topk.topk_ids", request.topk.topk_ids))
            named.append(("topk.topk_weights", request.topk.topk_weights))
        else:
            raise RunInputError("routing", "required: router_logits or topk")
        for field in ("warmup_iterations", "timed_iterations"):
            if getattr(request, field) > MAX_ITERATIONS:
                raise RunInputError(field, f"at most {MAX_ITERATIONS} (each is a whole forward)")
        specs = []
        for field, message in named:
            data = message.data  # one read: protobuf copies the bytes on each
            specs.append((field, wire_tensor(message, field, data=data), data))
        params: dict[str, Any] = {
            "backend": request.backend.strip().upper(),
            "validate": request.validate_inputs,
            "warmup": request.warmup_iterations,
            "timed": request.timed_iterations or 1,
            "compare": request.compare_with_reference,
        }
        if which == "layer_id":
            if not request.layer_id:
                raise RunInputError("layer_id", "required: the id ConvertWeights returned")
            worker = await self._holder(request)
            params["layer_id"] = request.layer_id
            inline_tensors: list[tuple[str, TensorSpec, bytes]] = []
        else:
            index = request.worker_index if request.HasField("worker_index") else None
            worker = self._workers.place(index)
            params["inline"], inline_tensors = self._inline(
                request.inline_layer, worker.index, params["backend"]
            )
        segments = self._segments()
        pool = self._pool_of(segments)
        prefix = f"r{next(self._calls)}-{self._token}-"
        lent: list[Pooled] = []
        answered = spilled = False
        try:
            params["segments_dir"] = str(segments.path)
            params["inputs"] = [self._put(pool, lent, s, d) for _, s, d in specs]
            if inline_tensors:
                params["inline"]["tensors"] = [
                    self._put(pool, lent, s, d) for _, s, d in inline_tensors
                ]
            # The output is [tokens, hidden] in the hidden states' dtype: its pooled segment
            # is lent up front; a worker whose output does not fit writes a new one instead.
            out_segment = self._take(pool, lent, len(specs[0][2]))
            params["out_segment"] = out_segment.name
            params["out_capacity"] = out_segment.capacity
            params["out_spill"] = f"{prefix}out"
            try:
                answer = await worker.call(
                    "run_moe",
                    params,
                    cancellable=True,
                    on_abandon=lambda late: _discard(segments.remove(prefix)),
                )
            except WorkerCallError as exc:
                answered = True
                raise from_worker(exc, request.layer_id) from None
            answered = True
            output = answer["output"]
            described = output["spec"]
            shape = [int(d) for d in described["shape"]]
            nbytes = int(described["byte_size"])
            spilled = output["segment"] != out_segment.name
            # The reply is built while the output's segment is still lent to this call.
            if not spilled:
                result = reply(
                    self._reply(request, worker.index, answer, shape, out_segment.view(nbytes))
                )
            else:
                with segments.open(output["segment"], nbytes) as segment:
                    result = reply(self._reply(request, worker.index, answer, shape, segment.view))
        finally:
            # Once the worker has answered it maps none of them; otherwise (cancelled, the
            # worker gone) it may still: their files go, its mappings stay valid.
            (pool.give if answered else pool.drop)(lent)
            self._schedule_trim(pool)
            if spilled or not answered:
                segments.remove(prefix)  # the worker's own output segment, if it made one
        seconds, tokens = self._metrics.run_moe_children(str(answer["backend"]))
        seconds.observe(float(answer["device_seconds"]))
        tokens.inc(int(answer.get("tokens", hidden[0])))
        return result

    @staticmethod
    def _reply(
        request: pb.RunMoERequest,
        worker_index: int,
        answer: dict[str, Any],
        shape: list[int],
        data: memoryview,
    ) -> Reply:
        """The response without its output, the output without its data, and that data (a
        view of a segment): apart, so the bytes path serializes each once, copying none."""
        rest = pb.RunMoEResponse(backend=str(answer["backend"]), worker_index=worker_index)
        # Duration.FromNanoseconds in two assignments (its Python checks cost more than the
        # rest of the message; a device time is never negative).
        rest.device_time.seconds, rest.device_time.nanos = divmod(
            int(float(answer["device_seconds"]) * 1e9), 1_000_000_000
        )
        if "max_abs_error" in answer:
            rest.max_abs_error = float(answer["max_abs_error"])
        head = tensor_pb2.Tensor(name="output", dtype=request.hidden_states.dtype, shape=shape)
        return Reply(rest, head, data)

    def _check_hidden(self, request: pb.RunMoERequest) -> tuple[int, int]:
        if not request.HasField("hidden_states"):
            raise RunInputError("hidden_states", "required: [tokens, hidden_size] bf16 or fp16")
        message = request.hidden_states
        dtype = _DTYPE_NAMES.get(message.dtype, "")
        if dtype not in HIDDEN_DTYPES:
            raise RunInputError(
                "hidden_states.dtype", f"must be bfloat16 or float16, got {dtype or 'unspecified'}"
            )
        shape = list(message.shape)
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
        return tokens, int(shape[1])

    async def _holder(self, request: pb.RunMoERequest) -> WorkerHandle:
        """The worker that holds the layer: the named one, else the one the pool's layer
        directory maps it to (a layer lost in its worker's restart says so)."""
        if request.HasField("worker_index"):
            return self._workers.worker(request.worker_index)
        return await self._workers.holder(request.layer_id)

    def _inline(
        self, layer: pb.InlineLayer, index: int, backend: str
    ) -> tuple[dict[str, Any], list[tuple[str, TensorSpec, bytes]]]:
        """What the worker needs to convert inline weights on the fly, and their tensors."""
        if not layer.tensors:
            raise RunInputError("inline_layer.tensors", "required: the layer's checkpoint tensors")
        # Each read of a bytes field copies it (upb): every tensor's data is read once here,
        # for the limit and for the segments alike.
        datas = [message.data for message in layer.tensors]
        total = sum(map(len, datas))
        limit = self._settings.run_max_inline_bytes
        if total > limit:
            raise RunResourceError(
                "inline_layer.tensors",
                f"{total} bytes of inline weights exceed {limit} ({limit // MIB} MiB, setting "
                "run_max_inline_bytes); convert with keep_loaded and run by layer_id",
                "run_max_inline_bytes",
            )
        spec = codec.spec_to_json(layer.spec)
        spec["platform"] = None
        deployment = parse_deployment(spec, default_platform=self._workers.profile(index))
        source = source_spec(
            deployment.hf_quantization_config, quantization=deployment.quantization
        )
        target = resolve_target(deployment, backend, field="backend")
        tensors = []
        for number, (message, data) in enumerate(zip(layer.tensors, datas, strict=True)):
            field = f"inline_layer.tensors[{message.name or number}]"
            tensors.append((field, wire_tensor(message, field, message.name, data), data))
        shape = deployment.layer
        return {
            "source": source.to_json(),
            "backend": target.backend,
            "shape": {
                "num_experts": shape.num_experts,
                "hidden_size": shape.hidden_size,
                "intermediate_size": shape.intermediate_size,
                "gated": shape.is_gated,
            },
            "quantization": deployment.quantization,
            "deployment": deployment.to_json(),
        }, tensors

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
    ) -> dict[str, Any]:
        item = self._take(pool, lent, len(data))
        if data:
            item.view(len(data))[:] = data
        return {"spec": spec.to_json(), "segment": item.name}


@dataclass(frozen=True, slots=True)
class Reply:
    """A RunMoE response in three parts: the response without its output (`rest`), the
    output without its data (`head`), and the data (valid only while the call holds its
    segment)."""

    rest: pb.RunMoEResponse
    head: tensor_pb2.Tensor
    data: memoryview


def _reply_message(reply: Reply) -> pb.RunMoEResponse:
    # The output filled in place: a Tensor with its data passed as `output=` is copied
    # whole into the response (25 ms against 1 ms for 8 MiB here, bench/RESULTS.md); the
    # head has no data yet, so copying it costs nothing.
    response = reply.rest
    response.output.CopyFrom(reply.head)
    response.output.data = bytes(reply.data)
    return response


def _varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


#: Wire tags (field number << 3 | 2, length-delimited) of RunMoEResponse.output and
#: Tensor.data: both are emitted by hand, everything else by protobuf.
_OUTPUT_TAG = _varint(pb.RunMoEResponse.OUTPUT_FIELD_NUMBER << 3 | 2)
_DATA_TAG = _varint(tensor_pb2.Tensor.DATA_FIELD_NUMBER << 3 | 2)


def reply_bytes(reply: Reply) -> bytes:
    """Exactly `SerializeToString()` of the response with its output's data filled in, the
    data copied once, from its segment into the result. Protobuf serializes fields in
    number order: output (1) first, and within it data (5) last, so the bytes are the
    output's tag and length, its small fields, data's tag, length and bytes, then the
    response's other fields. proto3 leaves empty bytes out, and so does this."""
    data = reply.data
    head = reply.head.SerializeToString()
    data_part = _DATA_TAG + _varint(len(data)) if len(data) else b""
    length = len(head) + len(data_part) + len(data)
    return b"".join(
        (_OUTPUT_TAG, _varint(length), head, data_part, data, reply.rest.SerializeToString())
    )


def _discard(value: object) -> None:
    """For callbacks that must return None."""
