"""ConvertWeights' use case, both modes, in domain types.

Inline: the header is checked and the target resolved before a byte of tensor data is
accepted (an unknown backend, a backend without a writer or a bad deployment fails at
once). Each tensor's declaration reserves its size against the per-call budget and gets a
segment (segments.py) that its chunks are assembled into, in order, checksummed; the
server process never holds more than one chunk of its own. The worker converts from the
segments into new ones; their tensors stream back in chunks, then the summary. However the
call ends (answered, failed, cancelled, the worker died) every segment with the call's
prefix is deleted, and a layer kept loaded for a call that did not complete is unloaded.

Path mode: the paths are confined to the data root here (`plan_job`), the worker runs the
whole-checkpoint job, and its progress events become ConvertProgress messages. With more
than one ready worker and no worker named, the job is spread over all of them by layer
ranges (spread.py).

Placement: a header naming `worker_index` converts there; otherwise the pool picks a ready
worker (for keep_loaded, the one holding the fewest kept-layer bytes), and the kept layer's
id is remembered with its worker, so RunMoE, ListLayers and UnloadLayer find it.

The call's input is a header (`ConvertHeader`) and a stream of `TensorDeclared` and
`ChunkReceived` items; its output a stream of `TensorSent`, `ChunkSent` and `Progress`
events ending with one `Summary`. The gRPC edge maps messages to these and back.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import secrets
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from service.dataplane import spread
from service.dataplane.errors import conversion_error
from service.dataplane.selection import PlatformChoice
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
from service.ipc.messages import (
    CheckpointConverted,
    CheckTarget,
    ConvertCheckpoint,
    ConvertLayer,
    LayerConverted,
    LayerShape,
    SegmentTensor,
)
from service.ipc.segments import Segment, SegmentDir
from service.metrics import Metrics
from service.oracle import (
    DeploymentSpec,
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


@dataclass(frozen=True, slots=True)
class CheckpointPaths:
    """Path mode: a checkpoint directory under the data root, where to write, and the
    decoder layers [start, end) to convert (None: all)."""

    input_dir: str
    output_dir: str
    layers: tuple[int, int] | None = None


@dataclass(frozen=True, slots=True)
class ConvertHeader:
    """What a ConvertWeights call asks for. `deployment()` gives the deployment spec (it
    raises the spec's errors when the call judges it, in order with the other checks);
    `names_deployment` says whether the call named one at all (path mode may read it from
    the checkpoint's config.json). `checkpoint` is None in inline mode."""

    deployment: Callable[[], dict[str, Any]]
    names_deployment: bool
    platform: PlatformChoice | None = None
    target_backend: str = ""
    ruleset: str = ""
    keep_loaded: bool = False
    worker_index: int | None = None
    max_chunk_bytes: int = 0
    return_tensors: bool = True
    checkpoint: CheckpointPaths | None = None


@dataclass(frozen=True, slots=True)
class TensorDeclared:
    """An inline tensor's declaration; its chunks follow."""

    spec: TensorSpec


@dataclass(frozen=True, slots=True)
class ChunkReceived:
    name: str
    offset: int
    data: bytes


@dataclass(frozen=True, slots=True)
class StrayHeader:
    """A header anywhere but first in the stream."""


StreamItem = TensorDeclared | ChunkReceived | StrayHeader


@dataclass(frozen=True, slots=True)
class TensorSent:
    """A converted tensor's declaration; its chunks follow."""

    spec: TensorSpec


@dataclass(frozen=True, slots=True)
class ChunkSent:
    name: str
    offset: int
    data: bytes


@dataclass(frozen=True, slots=True)
class Progress:
    layers_done: int
    layers_total: int
    bytes_done: int
    bytes_total: int
    current: str
    stage: str

    @classmethod
    def of(cls, event: Mapping[str, Any]) -> Progress:
        """A worker's (or the spread's) progress event."""
        return cls(
            layers_done=int(event.get("layers_done", 0)),
            layers_total=int(event.get("layers_total", 0)),
            bytes_done=int(event.get("bytes_done", 0)),
            bytes_total=int(event.get("bytes_total", 0)),
            current=str(event.get("current", "")),
            stage=str(event.get("stage", "")),
        )


@dataclass(frozen=True, slots=True)
class Summary:
    """The call's last event. Inline mode lists the converted tensors (`tensors`), path
    mode the written ones as the manifest lists them (`manifest_tensors`)."""

    backend: str
    experts_class: str
    descriptor: Mapping[str, Any] | None
    chosen_by: str
    bytes_in: int
    bytes_out: int
    elapsed_s: float
    device_seconds: float
    tensors: tuple[TensorSpec, ...] = ()
    manifest_tensors: tuple[Mapping[str, Any], ...] = field(default=())
    layer_id: str = ""
    manifest_path: str = ""
    layers_converted: int = 0
    layers_skipped: int = 0


Event = TensorSent | ChunkSent | Progress | Summary


class Converter:
    """One per server; `convert` serves one ConvertWeights call."""

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

    async def convert(
        self, header: ConvertHeader, stream: AsyncIterator[StreamItem]
    ) -> AsyncGenerator[Event, None]:
        started = time.perf_counter()
        # A named worker converts; otherwise the pool places the call (a layer to keep goes
        # where the fewest kept-layer bytes are; a whole checkpoint may spread over all).
        worker = self._workers.place(header.worker_index, by_memory=header.keep_loaded)
        platform = self._platform(header, self._workers.profile(worker.index))
        if header.checkpoint is not None:
            events = self._checkpoint(header, header.checkpoint, worker, platform, started)
        else:
            events = self._inline(header, stream, worker, platform, started)
        try:
            async with contextlib.aclosing(events):
                async for event in events:
                    yield event
        except (asyncio.CancelledError, GeneratorExit):
            # The caller cancelled or went away while the conversion ran or streamed back.
            log.info(
                "conversion cancelled by the caller",
                extra={
                    "event": "convert_cancelled",
                    "mode": "checkpoint" if header.checkpoint is not None else "inline",
                    "worker": worker.index,
                    "elapsed_s": round(time.perf_counter() - started, 3),
                },
            )
            raise

    def _platform(self, header: ConvertHeader, own: PlatformProfile) -> PlatformProfile:
        """The platform `auto` means: the header's what-if platform, else the worker's."""
        if header.platform is None:
            return own
        override = header.platform.resolve(self._workers.profile)
        if isinstance(override, str):
            return preset(override, field_name="platform.preset")
        return PlatformProfile.from_json(override, field_prefix="platform.profile")

    async def _check_writer(self, worker: WorkerHandle, target: Target) -> None:
        """UNIMPLEMENTED before any data moves when the worker has no writer for the target."""
        answer = await worker.call(CheckTarget(target.backend))
        if not answer.supported:
            hint = ""
            if target.chosen_by == "oracle":
                hint = " (vLLM's choice for this platform; name a target_backend or a platform)"
            raise NotImplementedError(
                f"ConvertWeights cannot write {target.backend}{hint}: {answer.reason}"
            )

    def _chunk_limit(self, header: ConvertHeader) -> int:
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
        header: ConvertHeader,
        stream: AsyncIterator[StreamItem],
        worker: WorkerHandle,
        platform: PlatformProfile,
        started: float,
    ) -> AsyncGenerator[Event, None]:
        spec = header.deployment()
        spec["platform"] = None
        deployment = parse_deployment(spec, default_platform=platform)
        source = source_spec(
            deployment.hf_quantization_config, quantization=deployment.quantization
        )
        target = resolve_target(deployment, header.target_backend, ruleset=header.ruleset)
        await self._check_writer(worker, target)
        return_tensors = header.return_tensors
        segments = self.segments()
        prefix = f"c{next(self._calls)}-{secrets.token_hex(3)}-"
        layer_id = ""
        try:
            inputs = await self._receive(stream, segments, prefix)
            call = ConvertLayer(
                segments_dir=str(segments.path),
                inputs=inputs,
                source=source,
                backend=target.backend,
                ruleset=target.ruleset,
                shape=_shape(deployment),
                out_prefix=f"{prefix}out-",
                experts_class=target.experts_class,
                quantization=deployment.quantization,
                keep_loaded=header.keep_loaded,
                return_tensors=return_tensors,
                deployment=deployment.to_json(),
                layer_budget_bytes=self._settings.layer_budget_mib * MIB,
            )

            def abandoned(late: LayerConverted | None) -> None:
                """The call ended before the worker: clean up after it once it answers."""
                kept_id = late.layer_id if late is not None else ""
                log.info(
                    "cleaning up after an abandoned conversion",
                    extra={"event": "convert_abandoned", "kept_layer": bool(kept_id)},
                )
                segments.remove(prefix)
                if kept_id:
                    task = asyncio.ensure_future(self._drop(kept_id))
                    self._cleanup.add(task)
                    task.add_done_callback(self._cleanup.discard)

            try:
                answer = await worker.call(call, on_abandon=abandoned)
            except WorkerCallError as exc:
                raise conversion_error(exc) from None
            layer_id = answer.layer_id
            if layer_id:
                kept = sum(t.spec.byte_size for t in answer.tensors)
                self._workers.remember(layer_id, worker, kept)
            limit = self._chunk_limit(header)
            sent = []
            for item in answer.tensors:
                out = item.spec
                sent.append(out)
                if not item.segment:
                    continue
                yield TensorSent(out)
                with segments.open(item.segment, out.byte_size) as segment:
                    for offset, part in chunks(segment.view, limit):
                        data = bytes(part)
                        del part  # no view into the mapping survives a suspension
                        yield ChunkSent(out.name, offset, data)
                segments.file(item.segment).unlink(missing_ok=True)
            bytes_in = sum(i.spec.byte_size for i in inputs)
            bytes_out = sum(spec.byte_size for spec in sent)
            elapsed = time.perf_counter() - started
            self._count(target.backend, elapsed, bytes_in, bytes_out)
            yield Summary(
                backend=target.backend,
                experts_class=target.experts_class,
                descriptor=answer.descriptor,
                chosen_by=target.chosen_by,
                bytes_in=bytes_in,
                bytes_out=bytes_out,
                elapsed_s=elapsed,
                device_seconds=answer.device_seconds,
                tensors=tuple(sent),
                layer_id=layer_id,
            )
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
        stream: AsyncIterator[StreamItem],
        segments: SegmentDir,
        prefix: str,
    ) -> tuple[SegmentTensor, ...]:
        """Assemble every streamed tensor into its own segment; returns their descriptions."""
        budget = StreamBudget(self._settings.convert_max_layer_bytes)
        inputs: list[SegmentTensor] = []
        names: set[str] = set()
        current: TensorAssembler | None = None
        segment: Segment | None = None

        def finish() -> None:
            nonlocal current, segment
            if current is None or segment is None:
                return
            digest = current.finish()
            segment.close()
            inputs[-1] = dataclasses.replace(
                inputs[-1], spec=dataclasses.replace(inputs[-1].spec, sha256=digest)
            )
            current = segment = None

        try:
            async for item in stream:
                if isinstance(item, TensorDeclared):
                    finish()
                    spec = item.spec
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
                    inputs.append(SegmentTensor(spec, name))
                elif isinstance(item, ChunkReceived):
                    if current is None:
                        raise StreamError(
                            f"tensors[{item.name}].chunk",
                            "a chunk arrived before its TensorHeader",
                        )
                    current.feed(item.name, item.offset, item.data)
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
        normalize_names([item.spec.name for item in inputs])
        return tuple(inputs)

    # -- path mode

    async def _checkpoint(
        self,
        header: ConvertHeader,
        request: CheckpointPaths,
        worker: WorkerHandle,
        platform: PlatformProfile,
        started: float,
    ) -> AsyncGenerator[Event, None]:
        if self._settings.data_root is None:
            raise PermissionDeniedError(
                "checkpoint.input_dir",
                request.input_dir,
                "this server has no data root (--data-root), so path-mode conversions are off",
            )
        root = DataRoot.at(self._settings.data_root)
        deployment = None
        if header.names_deployment:
            deployment = header.deployment()
        else:
            source_dir = root.resolve(request.input_dir, "checkpoint.input_dir")
            deployment = deployment_from_model_config(read_model_config(source_dir, root))
        layers = request.layers
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
        if header.worker_index is None and ready > 1:
            plan = await asyncio.to_thread(spread.plan_spread, job, ready)

        async def whole() -> CheckpointConverted:
            return await worker.call(
                ConvertCheckpoint(job.to_json()),
                on_event=lambda _name, data: events.put_nowait(data),
            )

        call: asyncio.Task[spread.SpreadAnswer] | asyncio.Task[CheckpointConverted]
        if plan is not None:
            call = asyncio.create_task(
                spread.run_spread(self._workers, job.to_json(), plan, events.put_nowait)
            )
        else:
            call = asyncio.create_task(whole())
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
                yield Progress.of(event)
            try:
                result = call.result()
            except WorkerCallError as exc:
                raise conversion_error(exc) from None
            answer = result.converted if isinstance(result, spread.SpreadAnswer) else result
            # Where the workers' time went, per stage summed over layers (worker seconds).
            stages = {k: round(v, 3) for k, v in answer.stage_seconds.items()}
            if isinstance(result, spread.SpreadAnswer):
                log.info(
                    "checkpoint conversion spread over workers",
                    extra={
                        "event": "convert_spread",
                        "ranges": len(result.workers) - 1,
                        "workers": list(result.workers),
                        "layers_by_worker": result.layers_by_worker,
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
        self._count(job.target.backend, elapsed, answer.bytes_in, answer.bytes_out)
        yield Summary(
            backend=job.target.backend,
            experts_class=job.target.experts_class,
            descriptor=answer.descriptor,
            chosen_by=job.target.chosen_by,
            bytes_in=answer.bytes_in,
            bytes_out=answer.bytes_out,
            elapsed_s=elapsed,
            device_seconds=answer.device_seconds,
            manifest_tensors=answer.tensors,
            manifest_path=_shown(answer.manifest_path, root),
            layers_converted=answer.layers_converted,
            layers_skipped=answer.layers_skipped,
        )


def _shape(deployment: DeploymentSpec) -> LayerShape:
    layer = deployment.layer
    return LayerShape(layer.num_experts, layer.hidden_size, layer.intermediate_size, layer.is_gated)


def _shown(path: str, root: DataRoot) -> str:
    """A written path as the client should see it: relative to the data root."""
    if not path:
        return ""
    with contextlib.suppress(ValueError):
        return str(Path(path).relative_to(root.root))
    return path


async def _until_done(
    call: asyncio.Task[Any], events: asyncio.Queue[dict[str, Any]]
) -> AsyncIterator[dict[str, Any]]:
    """Events of a running worker call, until it ends (then whatever is still queued).

    The wait for the next event is a task of its own; however the wait ends (an event, the
    call done, the caller cancelled) that task is finished before this goes on, so a
    cancelled stream leaves no task pending for the garbage collector to report."""
    while not call.done():
        getter = asyncio.ensure_future(events.get())
        try:
            await asyncio.wait({call, getter}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not getter.done():
                getter.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await getter
        if not getter.cancelled():
            yield getter.result()
    while not events.empty():
        yield events.get_nowait()
