"""SelectBackend's MEASURED policy: time what the serving worker runs, keep what was timed.

vLLM's static choice is a priority list; which backend is fastest for a layer depends on its
shape and the token count. The measured policy decides statically first (the same answer,
counted in the same metrics), then asks the serving worker to time every backend it runs
(`measure_backends`, service/worker/measure.py) on synthetic weights of the layer's shape and
quantization, and answers per token count with the fastest backend beside vLLM's choice and
its time.

Timings are cached by what they depend on: the device (name, capability), the software
(torch, the worker's kernel packages, this service's version), the layer (experts, top-k,
hidden, intermediate, activation, dtype) and its quantization (bits, group size, symmetry,
act-order, checkpoint layout). Only the token counts missing from the cache are timed; a
repeat request is answered from memory without touching the worker. With a state dir the
cache is a JSON file there, replaced atomically (write a temporary file, fsync, rename), so
timings survive restarts and a crash never leaves half a file.

A replica process (several server processes) has no workers: it forwards MEASURED requests
to the primary (`ForwardedMeasure`), which measures and keeps the cache.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import os
import tempfile
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from service import __version__
from service.api.generated.moe_control.v1 import measured_pb2, selection_pb2
from service.api.generated.moe_control.v1 import moe_control_service_pb2 as pb
from service.formats.routes.spec import source_spec
from service.kernels.registry import RUNNABLE
from service.oracle import DEFAULT_RULESET, InvalidSpecError, SelectionError, parse_deployment
from service.pool.errors import WorkerCallError, WorkerUnavailableError

if TYPE_CHECKING:
    from service.api.selection import Selection
    from service.pool.pool import WorkerPool

log = logging.getLogger("moe_control.measured")

MEASURED = measured_pb2.SELECTION_POLICY_MEASURED
#: Token counts timed when a request names none.
DEFAULT_TOKENS = (1, 16, 256, 4096)
MAX_TOKENS = 16384
MAX_BUCKETS = 16
CACHE_FILE = "measured_backends.json"
#: Cache-served answers kept as bytes, by request bytes (least recently used dropped).
MAX_KEPT_ANSWERS = 1024
CACHE_VERSION = 1


class MeasuredAnswerer(Protocol):
    """What Selection calls for a MEASURED request (the primary's policy, or a forwarder)."""

    async def answer_bytes(
        self, selection: Selection, data: bytes, request: pb.SelectBackendRequest, context: Any
    ) -> bytes: ...

    async def answer(
        self, selection: Selection, request: pb.SelectBackendRequest
    ) -> pb.SelectBackendResponse: ...


# ---------------------------------------------------------------------------------------
# The cache


class MeasureStore:
    """Timings by cache key: {key: {"parts", "versions", "device_name", "buckets": {tokens:
    {"time", "timings": [{"backend", "seconds", "error"}]}}}}, in memory and, with a
    directory, in `CACHE_FILE` there."""

    def __init__(self, directory: Path | None) -> None:
        self.path = None if directory is None else Path(directory) / CACHE_FILE
        self.entries: dict[str, dict[str, Any]] = {}
        #: Moves on with every put (answers kept as bytes are stale after one).
        self.revision = 0
        if self.path is not None and self.path.exists():
            try:
                loaded = json.loads(self.path.read_text())
                if loaded.get("version") == CACHE_VERSION:
                    self.entries = dict(loaded.get("entries") or {})
            except (OSError, ValueError, AttributeError) as exc:
                # A damaged file costs a re-measure, never a failed request.
                log.warning("ignoring unreadable measure cache %s: %s", self.path, exc)

    def get(self, key: str) -> dict[str, Any] | None:
        return self.entries.get(key)

    def put(self, key: str, entry: dict[str, Any]) -> None:
        self.entries[key] = entry
        self.revision += 1
        if self.path is not None:
            self._save(self.path)

    def _save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        payload = json.dumps({"version": CACHE_VERSION, "entries": self.entries}, indent=1)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
        try:
            with os.fdopen(fd, "w") as handle:
                handle.write(payload)
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise


# ---------------------------------------------------------------------------------------
# The request's facts


@dataclass(frozen=True)
class Job:
    """What to measure and the key it is cached under."""

    worker_index: int
    key: str
    parts: dict[str, Any]
    params: dict[str, Any]
    tokens: tuple[int, ...]
    backends: tuple[str, ...]


def token_counts(request: pb.SelectBackendRequest) -> tuple[int, ...]:
    counts = tuple(sorted(set(request.token_counts))) or DEFAULT_TOKENS
    if len(counts) > MAX_BUCKETS or not all(1 <= c <= MAX_TOKENS for c in counts):
        raise InvalidSpecError.single(
            "token_counts", f"at most {MAX_BUCKETS} counts, each in 1..{MAX_TOKENS}"
        )
    return counts


def usable_backends(response: pb.SelectBackendResponse) -> tuple[str, ...]:
    """Every backend a worker has a kernel for. Those vLLM would reject for the layer are
    timed too (the response's `candidates` say why vLLM would not run them): the answer is
    what runs fastest here, and the static choice's time stands beside it."""
    return RUNNABLE


def cache_key(parts: dict[str, Any]) -> str:
    text = json.dumps(parts, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def make_job(
    request: pb.SelectBackendRequest,
    response: pb.SelectBackendResponse,
    spec_json: dict[str, Any],
    workers: WorkerPool,
) -> Job:
    """The measurement a request asks for, on which worker, under which key."""
    index = request.measure_worker_index if request.HasField("measure_worker_index") else None
    which = request.platform.WhichOneof("source")
    if which == "worker_index":
        index = request.platform.worker_index if index is None else index
    elif which is not None or spec_json.get("platform") is not None:
        raise InvalidSpecError.single(
            "policy",
            "MEASURED times backends on a serving worker: leave the platform to the worker "
            "(no preset, profile or platform in the spec)",
        )
    index = 0 if index is None else index
    snapshot = workers.worker(index).snapshot()
    if snapshot.profile is None:
        raise WorkerUnavailableError(f"worker {index} is not ready to measure")
    deployment = parse_deployment(spec_json, default_platform=snapshot.profile)
    source = source_spec(
        deployment.hf_quantization_config, quantization=deployment.quantization
    ).to_json()
    layer = deployment.layer
    shape = {
        "num_experts": layer.num_experts,
        "top_k": layer.top_k,
        "hidden_size": layer.hidden_size,
        "intermediate_size": layer.intermediate_size,
        "activation": layer.activation,
        "dtype": layer.dtype,
    }
    profile = snapshot.profile.to_json()
    backends = usable_backends(response)
    parts = {
        "device": snapshot.device_name,
        "platform": {k: profile.get(k) for k in ("device", "capability", "arch", "packages")},
        "torch": snapshot.torch_version,
        "service": __version__,
        "shape": shape,
        "quantization": source,
        "backends": list(backends),
    }
    params = {"shape": shape, "source": source, "backends": list(backends)}
    return Job(index, cache_key(parts), parts, params, token_counts(request), backends)


# ---------------------------------------------------------------------------------------
# The policy


@dataclass(frozen=True)
class KeptAnswer:
    """A cache-served MEASURED answer's bytes, valid under one worker generation and one
    store revision, and how to count its static decision again."""

    generation: int
    revision: int
    payload: bytes
    recount: Callable[[], None]


class MeasuredPolicy:
    """The primary's MEASURED answers: static decision + cached or fresh worker timings."""

    def __init__(
        self,
        workers: WorkerPool,
        state_dir: Path | None,
        *,
        budget_s: float = 0.2,
        timeout_s: float = 600.0,
    ) -> None:
        self._workers = workers
        self.store = MeasureStore(state_dir)
        self.budget_s = budget_s
        self.timeout_s = timeout_s
        self._lock = asyncio.Lock()  # one measurement at a time: they share the device
        self._answers: OrderedDict[bytes, KeptAnswer] = OrderedDict()

    async def answer_bytes(
        self, selection: Selection, data: bytes, request: pb.SelectBackendRequest, context: Any
    ) -> bytes:
        """The answer's bytes; a repeat of a request answered from the cache is served as
        kept bytes (no decision, no parsing) while no worker and no timing has changed, and
        counted in the metrics exactly like a fresh answer."""
        generation, revision = selection.generation, self.store.revision
        kept = self._answers.get(data)
        fresh = kept is not None and (kept.generation, kept.revision) == (generation, revision)
        if kept is not None and fresh and not request.refresh:
            self._answers.move_to_end(data)
            kept.recount()
            return kept.payload
        response, recount = await self._answer(selection, request)
        payload: bytes = response.SerializeToString()
        if response.measured.from_cache and self.store.revision == revision:
            self._answers[data] = KeptAnswer(generation, revision, payload, recount)
            while len(self._answers) > MAX_KEPT_ANSWERS:
                self._answers.popitem(last=False)
        return payload

    async def answer(
        self, selection: Selection, request: pb.SelectBackendRequest
    ) -> pb.SelectBackendResponse:
        response, _ = await self._answer(selection, request)
        return response

    async def _answer(
        self, selection: Selection, request: pb.SelectBackendRequest
    ) -> tuple[pb.SelectBackendResponse, Callable[[], None]]:
        """The measured answer and how to count its static decision again."""
        from service.api import codec

        if request.HasField("measure_worker_index") and not request.platform.WhichOneof("source"):
            # decide for the worker that measures (the default would be worker 0's platform)
            pinned = pb.SelectBackendRequest()
            pinned.CopyFrom(request)
            pinned.platform.worker_index = request.measure_worker_index
            request = pinned
        recount: Callable[[], None]
        try:
            response, counters = selection.decide(request)  # counted as always

            def recount() -> None:
                for counter in counters:
                    counter.inc()

        except SelectionError as exc:
            response = failed_static(request, exc)
            candidates = exc.candidates

            def recount() -> None:
                selection.count_rejections(candidates)

        spec_json = codec.deployment_to_json(request)
        job = make_job(request, response, spec_json, self._workers)
        started = time.perf_counter()
        entry = self.store.get(job.key)
        missing = [t for t in job.tokens if request.refresh or not _has(entry, t)]
        if missing:
            async with self._lock:
                entry = self.store.get(job.key)  # another request may have measured them
                missing = [t for t in job.tokens if request.refresh or not _has(entry, t)]
                if missing:
                    entry = await self._measure(job, entry, missing)
        assert entry is not None
        static = response.backend if response.HasField("backend") else ""
        fill(response.measured, job, entry, static)
        response.measured.from_cache = not missing
        response.measured.measure_seconds = time.perf_counter() - started if missing else 0.0
        return response, recount

    async def _measure(
        self, job: Job, entry: dict[str, Any] | None, tokens: list[int]
    ) -> dict[str, Any]:
        worker = self._workers.worker(job.worker_index)
        params = {**job.params, "token_counts": tokens, "budget_s": self.budget_s}
        try:
            answer = await worker.call(
                "measure_backends", params, timeout=self.timeout_s, cancellable=True
            )
        except WorkerCallError as exc:
            from service.api.run_moe import from_worker

            raise from_worker(exc) from exc
        entry = dict(entry or {"parts": job.parts, "buckets": {}})
        entry["device_name"] = str(answer.get("device_name", ""))
        entry["versions"] = {str(k): str(v) for k, v in (answer.get("versions") or {}).items()}
        now = time.time()
        buckets = dict(entry.get("buckets") or {})
        for count in tokens:
            timings = []
            for result in answer.get("results", []):
                seconds = (result.get("seconds") or {}).get(str(count))
                timings.append(
                    {
                        "backend": str(result.get("backend", "")),
                        "seconds": None if seconds is None else float(seconds),
                        "error": str(result.get("error", "")),
                    }
                )
            buckets[str(count)] = {"time": now, "timings": timings}
        entry["buckets"] = buckets
        self.store.put(job.key, entry)
        return entry


def failed_static(
    request: pb.SelectBackendRequest, exc: SelectionError
) -> pb.SelectBackendResponse:
    """The static part of a MEASURED answer where vLLM itself would fail the deployment: no
    backend, every candidate with its reason, and the failure as a hazard. The timings
    still say what this worker runs (a static request gets FAILED_PRECONDITION instead)."""
    from service.api import codec

    response = pb.SelectBackendResponse(
        ruleset=request.ruleset or DEFAULT_RULESET,
        quantization=exc.quantization or "",
        moe_method=exc.moe_method or "",
        candidates=[codec.candidate_to_pb(c) for c in exc.candidates],
        hazards=[
            selection_pb2.Hazard(
                code="VLLM_FAILS", message=f"vLLM would fail ({exc.error.stage}): {exc}"
            )
        ],
    )
    return response


def _has(entry: dict[str, Any] | None, tokens: int) -> bool:
    return entry is not None and str(tokens) in (entry.get("buckets") or {})


def fill(
    message: measured_pb2.MeasuredSelection, job: Job, entry: dict[str, Any], static: str
) -> None:
    """The response's `measured` part from a cache entry, for the job's token counts."""
    message.worker_index = job.worker_index
    message.device_name = str(entry.get("device_name", job.parts.get("device", "")))
    message.versions.update(entry.get("versions") or {})
    oldest = None
    for count in job.tokens:
        bucket = entry["buckets"][str(count)]
        oldest = bucket["time"] if oldest is None else min(oldest, bucket["time"])
        out = message.buckets.add(tokens=count, static_backend=static)
        best: tuple[float, str] | None = None
        for timing in bucket["timings"]:
            item = out.timings.add(backend=timing["backend"], error=timing.get("error", ""))
            seconds = timing.get("seconds")
            if seconds is None:
                continue
            item.device_seconds = seconds
            if best is None or seconds < best[0]:
                best = (seconds, timing["backend"])
            if timing["backend"] == static:
                out.static_seconds = seconds
        if best is not None:
            out.fastest_seconds, out.fastest_backend = best
            if out.HasField("static_seconds") and best[0] > 0:
                out.speedup = out.static_seconds / best[0]
    if oldest is not None:
        message.measured_time.FromNanoseconds(int(oldest * 1e9))


class ForwardedMeasure:
    """A replica's MEASURED answers: the primary's, over the private socket (the primary
    has the workers and the cache)."""

    METHOD = "/moe_control.v1.MoeControlService/SelectBackend"

    def __init__(self, channel: Any) -> None:
        self._call = channel.unary_unary(self.METHOD)

    async def answer_bytes(
        self, selection: Selection, data: bytes, request: pb.SelectBackendRequest, context: Any
    ) -> bytes:
        import grpc

        from service.server.forward import abort_like, caller_metadata, remaining

        try:
            payload: bytes = await self._call(
                data, metadata=caller_metadata(context), timeout=remaining(context)
            )
        except grpc.aio.AioRpcError as error:
            await abort_like(error, context)
            raise
        return payload

    async def answer(
        self, selection: Selection, request: pb.SelectBackendRequest
    ) -> pb.SelectBackendResponse:
        payload = await self._call(request.SerializeToString())
        return pb.SelectBackendResponse.FromString(payload)


__all__ = ["DEFAULT_RULESET", "ForwardedMeasure", "MeasureStore", "MeasuredPolicy"]
