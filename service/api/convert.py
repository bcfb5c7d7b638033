"""ConvertWeights: the server side of both modes.

Inline: the header is checked and the target resolved before a byte of tensor data is
accepted (an unknown backend, a backend without a writer or a bad deployment fails at
once). Each tensor's declaration reserves its size against the per-call budget and gets a
segment (ipc/segments.py) that its chunks are assembled into, in order, checksummed; the
server process never holds more than one chunk of its own. The worker converts from the
segments into new ones; their tensors stream back in chunks, then the summary. However the
call ends (answered, failed, cancelled, the worker died) every segment with the call's
prefix is deleted, and a layer kept loaded for a call that did not complete is unloaded.

Path mode: the paths are confined to the data root here (`plan_job`), the worker runs the
whole-checkpoint job, and its progress events become ConvertProgress messages. With more
than one ready worker and no worker named, the job is spread over all of them by layer
ranges (convert_spread.py).

Placement: a header naming `worker_index` converts there; otherwise the pool picks a ready
worker (for keep_loaded, the one holding the fewest kept-layer bytes), and the kept layer's
id is remembered with its worker, so RunMoE, ListLayers and UnloadLayer find it.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import secrets
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from google.protobuf.message import DecodeError

from service.api import codec, convert_codec, convert_spread
from service.api.generated.moe_control.v1 import moe_control_service_pb2 as pb
from service.api.generated.moe_control.v1 import tensor_pb2
from service.formats.checkpoint.plan import plan_job, read_model_config
from service.formats.errors import (
    ConvertInputError,
    ConvertResourceError,
    PermissionDeniedError,
    StreamError,
)
from service.formats.io.naming import classify, normalize_names
from service.formats.io.paths import DataRoot
from service.formats.io.streaming import StreamBudget, TensorAssembler, TensorSpec, chunks
from service.formats.routes.spec import Target, resolve_target, source_spec
from service.ipc.errors import SegmentError
from service.ipc.segments import Segment, SegmentDir
from service.metrics import Metrics
from service.oracle import (
    DeploymentSpec,
    FieldViolation,
    InvalidSpecError,
    PlatformProfile,
    deployment_from_model_config,
    parse_deployment,
    preset,
)
from service.pool.errors import WorkerCallError
from service.pool.handle import WorkerHandle
from service.pool.pool import WorkerPool
from service.settings import MIB, Settings

log = logging.getLogger("moe_control.convert")

#: Free space /dev/shm needs for the segments to go there rather than to the temp dir.
_SHM_MINIMUM = 1 << 30
#: Room left in a response message for everything but a chunk's data.
_MESSAGE_OVERHEAD = 64 * 1024


def domain_error(exc: WorkerCallError) -> Exception:
    """The domain error a worker's error answer stands for (by its details' category)."""
    details = exc.details
    category = details.get("category")
    message = exc.message
    field = str(details.get("field", ""))
    description = str(details.get("description") or message.removeprefix(f"{field}: "))
    if category == "invalid_argument":
        return ConvertInputError(field or "tensors", description)
    if category == "permission_denied":
        return PermissionDeniedError(
            field or "checkpoint", str(details.get("path", "")), str(details.get("reason", message))
        )
    if category == "unimplemented":
        return NotImplementedError(message)
    if category == "invalid_spec":
        violations = [
            FieldViolation(str(v.get("field", "")), str(v.get("description", "")))
            for v in details.get("violations") or []
        ]
        return InvalidSpecError(violations or [FieldViolation(field, message)])
    if category == "resource_exhausted":
        return ConvertResourceError(message)
    return exc


class ConvertWeightsHandler:
    """One per server; `__call__` serves one ConvertWeights call."""

    def __init__(self, workers: WorkerPool, metrics: Metrics, settings: Settings) -> None:
        self._workers = workers
        self._metrics = metrics
        self._settings = settings
        self._segments: SegmentDir | None = None
        self._calls = itertools.count(1)
        #: Unloads of layers whose call was gone before the worker answered.
        self._cleanup: set[asyncio.Future[None]] = set()

    # -- life cycle

    def segments(self) -> SegmentDir:
        if self._segments is None:
            base = self._settings.segment_dir
            # /dev/shm when it can hold a typical layer (Docker's default 64 MiB cannot);
            # space for each tensor is reserved as it is declared, so running out there is
            # a RESOURCE_EXHAUSTED answer, never a crash.
            self._segments = SegmentDir.create(base, prefer_shm=_SHM_MINIMUM)
        return self._segments

    def close(self) -> None:
        if self._segments is not None:
            self._segments.destroy()
            self._segments = None

    # -- the call

    async def __call__(
        self, requests: AsyncIterator[pb.ConvertWeightsRequest], context: Any
    ) -> AsyncIterator[pb.ConvertWeightsResponse]:
        started = time.perf_counter()
        stream = _decoded(requests)
        first = await anext(stream, None)
        if first is None or first.WhichOneof("message") != "header":
            raise ConvertInputError(
                "header", "required: the first message of a ConvertWeights stream is its header"
            )
        header = first.header
        # A named worker converts; otherwise the pool places the call (a layer to keep goes
        # where the fewest kept-layer bytes are; a whole checkpoint may spread over all).
        named = header.worker_index if header.HasField("worker_index") else None
        worker = self._workers.place(named, by_memory=header.keep_loaded)
        platform = self._platform(header, self._workers.profile(worker.index))
        if header.WhichOneof("mode") == "checkpoint":
            responses = self._checkpoint(header, worker, platform, started)
        else:
            responses = self._inline(header, stream, worker, platform, started)
        async for response in responses:
            yield response

    def _platform(self, header: pb.ConvertWeightsHeader, own: PlatformProfile) -> PlatformProfile:
        """The platform `auto` means: the header's what-if platform, else the worker's."""
        override = codec.platform_override(header.platform, self._workers.profile)
        if override is None:
            return own
        if isinstance(override, str):
            return preset(override, field_name="platform.preset")
        return PlatformProfile.from_json(override, field_prefix="platform.profile")

    async def _check_writer(self, worker: WorkerHandle, target: Target) -> None:
        """UNIMPLEMENTED before any data moves when the worker has no writer for the target."""
        answer = await worker.call("check_target", {"backend": target.backend})
        if not answer.get("supported"):
            hint = ""
            if target.chosen_by == "oracle":
                hint = " (vLLM's choice for this platform; name a target_backend or a platform)"
            raise NotImplementedError(
                f"ConvertWeights cannot write {target.backend}{hint}: {answer.get('reason')}"
            )

    def _chunk_limit(self, header: pb.ConvertWeightsHeader) -> int:
        limit = self._settings.max_send_message_bytes - _MESSAGE_OVERHEAD
        asked = header.max_chunk_bytes or self._settings.convert_chunk_bytes
        return max(1, min(asked, limit))

    def _count(self, target: str, seconds: float, bytes_in: int, bytes_out: int) -> None:
        self._metrics.convert_bytes.labels(target, "in").inc(bytes_in)
        self._metrics.convert_bytes.labels(target, "out").inc(bytes_out)
        self._metrics.convert_seconds.labels(target).observe(seconds)

    # -- inline

    async def _inline(
        self,
        header: pb.ConvertWeightsHeader,
        stream: AsyncIterator[pb.ConvertWeightsRequest],
        worker: WorkerHandle,
        platform: PlatformProfile,
        started: float,
    ) -> AsyncIterator[pb.ConvertWeightsResponse]:
        spec = codec.deployment_to_json(header)
        spec["platform"] = None
        deployment = parse_deployment(spec, default_platform=platform)
        source = source_spec(
            deployment.hf_quantization_config, quantization=deployment.quantization
        )
        target = resolve_target(deployment, header.target_backend, ruleset=header.ruleset)
        await self._check_writer(worker, target)
        return_tensors = header.inline.return_tensors if header.HasField("inline") else True
        segments = self.segments()
        prefix = f"c{next(self._calls)}-{secrets.token_hex(3)}-"
        layer_id = ""
        try:
            inputs = await self._receive(stream, segments, prefix)
            params = {
                "segments_dir": str(segments.path),
                "inputs": inputs,
                "source": source.to_json(),
                "backend": target.backend,
                "experts_class": target.experts_class,
                "shape": _shape(deployment),
                "quantization": deployment.quantization,
                "keep_loaded": header.keep_loaded,
                "return_tensors": return_tensors,
                "out_prefix": f"{prefix}out-",
                "deployment": deployment.to_json(),
                "layer_budget_bytes": self._settings.layer_budget_mib * MIB,
            }

            def abandoned(late: dict[str, Any] | None) -> None:
                """The call ended before the worker: clean up after it once it answers."""
                log.info(
                    "cleaning up after an abandoned conversion",
                    extra={
                        "event": "convert_abandoned",
                        "kept_layer": bool(late and late.get("layer_id")),
                    },
                )
                segments.remove(prefix)
                if late and late.get("layer_id"):
                    task = asyncio.ensure_future(self._drop(str(late["layer_id"])))
                    self._cleanup.add(task)
                    task.add_done_callback(self._cleanup.discard)

            try:
                answer = await worker.call(
                    "convert_layer", params, cancellable=True, on_abandon=abandoned
                )
            except WorkerCallError as exc:
                raise domain_error(exc) from None
            layer_id = str(answer.get("layer_id", ""))
            if layer_id:
                kept = sum(TensorSpec.from_json(t["spec"]).byte_size for t in answer["tensors"])
                self._workers.remember(layer_id, worker, kept)
            limit = self._chunk_limit(header)
            headers = []
            for item in answer["tensors"]:
                out = TensorSpec.from_json(item["spec"])
                headers.append(convert_codec.tensor_header(out))
                if "segment" not in item:
                    continue
                yield pb.ConvertWeightsResponse(tensor=headers[-1])
                with segments.open(item["segment"], out.byte_size) as segment:
                    for offset, part in chunks(segment.view, limit):
                        data = bytes(part)
                        del part  # no view into the mapping survives a suspension
                        yield pb.ConvertWeightsResponse(
                            chunk=tensor_pb2.TensorChunk(name=out.name, offset=offset, data=data)
                        )
                segments.file(item["segment"]).unlink(missing_ok=True)
            bytes_in = sum(int(i["spec"]["byte_size"]) for i in inputs)
            bytes_out = sum(h.byte_size for h in headers)
            elapsed = time.perf_counter() - started
            self._count(target.backend, elapsed, bytes_in, bytes_out)
            summary = pb.ConvertSummary(
                target_format=convert_codec.kernel_format(
                    target.backend, target.experts_class, answer.get("descriptor")
                ),
                tensors=headers,
                bytes_in=bytes_in,
                bytes_out=bytes_out,
                layer_id=layer_id,
                backend_chosen_by=target.chosen_by,
            )
            summary.elapsed.FromNanoseconds(int(elapsed * 1e9))
            summary.device_time.FromNanoseconds(int(float(answer["device_seconds"]) * 1e9))
            yield pb.ConvertWeightsResponse(summary=summary)
            layer_id = ""  # delivered: the caller owns it now
        finally:
            segments.remove(prefix)
            if layer_id:
                await self._drop(layer_id)

    async def _drop(self, layer_id: str) -> None:
        """Unload a kept layer whose call did not complete (the caller never got its id)."""
        with contextlib.suppress(Exception):
            await asyncio.shield(self._workers.unload_layer(layer_id))

    async def _receive(
        self,
        stream: AsyncIterator[pb.ConvertWeightsRequest],
        segments: SegmentDir,
        prefix: str,
    ) -> list[dict[str, Any]]:
        """Assemble every streamed tensor into its own segment; returns their descriptions."""
        budget = StreamBudget(self._settings.convert_max_layer_bytes)
        inputs: list[dict[str, Any]] = []
        names: set[str] = set()
        current: TensorAssembler | None = None
        segment: Segment | None = None

        def finish() -> None:
            nonlocal current, segment
            if current is None or segment is None:
                return
            digest = current.finish()
            segment.close()
            inputs[-1]["spec"]["sha256"] = digest
            current = segment = None

        try:
            async for message in stream:
                kind = message.WhichOneof("message")
                if kind == "tensor":
                    finish()
                    spec = convert_codec.tensor_spec(message.tensor)
                    spec.validate()
                    classify(spec.name)  # an unknown name fails before its data moves
                    if spec.name in names:
                        raise StreamError(f"tensors[{spec.name}].name", "sent twice")
                    names.add(spec.name)
                    budget.reserve(spec)
                    name = f"{prefix}in-{len(inputs)}"
                    try:
                        segment = segments.new(name, spec.byte_size)
                    except SegmentError as exc:
                        raise ConvertResourceError(str(exc)) from None
                    current = TensorAssembler(spec, segment.view)
                    inputs.append({"spec": spec.to_json(), "segment": name})
                elif kind == "chunk":
                    chunk = message.chunk
                    if current is None:
                        raise StreamError(
                            f"tensors[{chunk.name}].chunk",
                            "a chunk arrived before its TensorHeader",
                        )
                    current.feed(chunk.name, chunk.offset, chunk.data)
                else:
                    raise ConvertInputError(
                        "header", "only the first message of the stream may be a header"
                    )
            finish()
        finally:
            if current is not None:
                # A failed feed or finish leaves frames (kept by the traceback) that hold
                # the assembler; released here, the mapping and its descriptor close now,
                # not at some later garbage collection (tests/reliability leak check).
                current.buffer.release()
            if segment is not None:
                segment.close()
        if not inputs:
            raise ConvertInputError(
                "tensors", "required: inline mode streams the layer's tensors after the header"
            )
        normalize_names([item["spec"]["name"] for item in inputs])
        return inputs

    # -- path mode

    async def _checkpoint(
        self,
        header: pb.ConvertWeightsHeader,
        worker: WorkerHandle,
        platform: PlatformProfile,
        started: float,
    ) -> AsyncIterator[pb.ConvertWeightsResponse]:
        request = header.checkpoint
        if self._settings.data_root is None:
            raise PermissionDeniedError(
                "checkpoint.input_dir",
                request.input_dir,
                "this server has no data root (--data-root), so path-mode conversions are off",
            )
        root = DataRoot.at(self._settings.data_root)
        deployment = None
        if header.WhichOneof("deployment") is not None:
            deployment = codec.deployment_to_json(header)
        else:
            source_dir = root.resolve(request.input_dir, "checkpoint.input_dir")
            deployment = deployment_from_model_config(read_model_config(source_dir, root))
        layers = (request.layers.start, request.layers.end) if request.HasField("layers") else None
        job = plan_job(
            request.input_dir,
            request.output_dir,
            root=root,
            platform=platform,
            backend=header.target_backend,
            ruleset=header.ruleset,
            layers=layers,
            deployment=deployment,
        )
        await self._check_writer(worker, job.target)
        events: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        plan = None
        ready = len(self._workers.ready_workers())
        if not header.HasField("worker_index") and ready > 1:
            plan = await asyncio.to_thread(convert_spread.plan_spread, job, ready)
        call: asyncio.Task[dict[str, Any]]
        if plan is not None:
            call = asyncio.create_task(
                convert_spread.run_spread(self._workers, job.to_json(), plan, events.put_nowait)
            )
        else:
            call = asyncio.create_task(
                worker.call(
                    "convert_checkpoint",
                    {"job": job.to_json()},
                    on_event=lambda _name, data: events.put_nowait(data),
                    cancellable=True,
                )
            )
        try:
            async for event in _until_done(call, events):
                if "stages" in event:  # a converted layer's stage times (ConvertProgress has none)
                    log.debug(
                        "checkpoint layer converted",
                        extra={
                            "event": "convert_layer_stages",
                            "layer": event.get("current", ""),
                            "stages": event["stages"],
                        },
                    )
                yield convert_codec.progress(event)
            try:
                answer = call.result()
            except WorkerCallError as exc:
                raise domain_error(exc) from None
            # Where the workers' time went, per stage summed over layers (worker seconds).
            stages = {k: round(float(v), 3) for k, v in (answer.get("stage_seconds") or {}).items()}
            if plan is not None:
                log.info(
                    "checkpoint conversion spread over workers",
                    extra={
                        "event": "convert_spread",
                        "ranges": len(plan.ranges),
                        "workers": answer.get("workers"),
                        "layers_by_worker": answer.get("layers_by_worker"),
                        "stage_seconds": stages,
                    },
                )
            else:
                log.info(
                    "checkpoint conversion done",
                    extra={"event": "convert_checkpoint", "stage_seconds": stages},
                )
        finally:
            if not call.done():
                call.cancel()
                with contextlib.suppress(BaseException):
                    await call
        elapsed = time.perf_counter() - started
        self._count(job.target.backend, elapsed, int(answer["bytes_in"]), int(answer["bytes_out"]))
        summary = pb.ConvertSummary(
            target_format=convert_codec.kernel_format(
                job.target.backend, job.target.experts_class, answer.get("descriptor")
            ),
            tensors=[convert_codec.safetensors_header(t) for t in answer.get("tensors", [])],
            bytes_in=int(answer["bytes_in"]),
            bytes_out=int(answer["bytes_out"]),
            manifest_path=_shown(str(answer.get("manifest_path", "")), root),
            layers_converted=int(answer["layers_converted"]),
            layers_skipped=int(answer["layers_skipped"]),
            backend_chosen_by=job.target.chosen_by,
        )
        summary.elapsed.FromNanoseconds(int(elapsed * 1e9))
        summary.device_time.FromNanoseconds(int(float(answer["device_seconds"]) * 1e9))
        yield pb.ConvertWeightsResponse(summary=summary)


def _shape(deployment: DeploymentSpec) -> dict[str, Any]:
    layer = deployment.layer
    return {
        "num_experts": layer.num_experts,
        "hidden_size": layer.hidden_size,
        "intermediate_size": layer.intermediate_size,
        "gated": layer.is_gated,
    }


def _shown(path: str, root: DataRoot) -> str:
    """A written path as the client should see it: relative to the data root."""
    if not path:
        return ""
    with contextlib.suppress(ValueError):
        return str(Path(path).relative_to(root.root))
    return path


async def _until_done(
    call: asyncio.Task[dict[str, Any]], events: asyncio.Queue[dict[str, Any]]
) -> AsyncIterator[dict[str, Any]]:
    """Events of a running worker call, until it ends (then whatever is still queued)."""
    while not call.done():
        getter = asyncio.ensure_future(events.get())
        done, _ = await asyncio.wait({call, getter}, return_when=asyncio.FIRST_COMPLETED)
        if getter in done:
            yield getter.result()
        else:
            getter.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await getter
    while not events.empty():
        yield events.get_nowait()


async def _decoded(
    requests: AsyncIterator[pb.ConvertWeightsRequest],
) -> AsyncIterator[pb.ConvertWeightsRequest]:
    """The request stream, a message grpc cannot parse as INVALID_ARGUMENT: grpc raises the
    DecodeError while reading, and unmapped it answered INTERNAL (tests/reliability)."""
    stream = aiter(requests)
    while True:
        try:
            message = await anext(stream)
        except StopAsyncIteration:
            return
        except DecodeError:
            raise ConvertInputError(
                "request", "a stream message is not a moe_control.v1.ConvertWeightsRequest"
            ) from None
        yield message
