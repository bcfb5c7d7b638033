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

This module is the primary's policy (it has the workers); a replica forwards its MEASURED
requests to the primary at the gRPC edge.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from service import __version__
from service.dataplane.errors import run_error
from service.dataplane.files import replace_file
from service.dataplane.selection import (
    Bucket,
    MeasuredSelection,
    MeasureOptions,
    PlatformChoice,
    SelectAnswer,
    Selector,
    SelectQuery,
    Timing,
)
from service.formats.routes.spec import source_spec
from service.ipc.messages import MeasureBackends
from service.kernels.registry import RUNNABLE
from service.oracle import DEFAULT_RULESET, InvalidSpecError, SelectionError, parse_deployment
from service.pool.errors import WorkerCallError, WorkerUnavailableError

if TYPE_CHECKING:
    from service.pool.pool import WorkerPool

log = logging.getLogger("moe_control.measured")

#: Token counts timed when a request names none.
DEFAULT_TOKENS = (1, 16, 256, 4096)
MAX_TOKENS = 16384
MAX_BUCKETS = 16
CACHE_FILE = "measured_backends.json"
CACHE_VERSION = 1


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
        payload = json.dumps({"version": CACHE_VERSION, "entries": self.entries}, indent=1)
        replace_file(path, payload)


# ---------------------------------------------------------------------------------------
# The request's facts


@dataclass(frozen=True)
class Job:
    """What to measure and the key it is cached under."""

    worker_index: int
    key: str
    parts: dict[str, Any]
    #: The worker's request, its token counts and budget filled in when it is sent.
    request: MeasureBackends
    tokens: tuple[int, ...]
    backends: tuple[str, ...]


def token_counts(counts: tuple[int, ...]) -> tuple[int, ...]:
    """The token counts to answer for: the request's, sorted and deduplicated, else the
    defaults; InvalidSpecError beyond the bounds."""
    counts = tuple(sorted(set(counts))) or DEFAULT_TOKENS
    if len(counts) > MAX_BUCKETS or not all(1 <= c <= MAX_TOKENS for c in counts):
        raise InvalidSpecError.single(
            "token_counts", f"at most {MAX_BUCKETS} counts, each in 1..{MAX_TOKENS}"
        )
    return counts


def usable_backends() -> tuple[str, ...]:
    """Every backend a worker has a kernel for. Those vLLM would reject for the layer are
    timed too (the answer's candidates say why vLLM would not run them): the answer is
    what runs fastest here, and the static choice's time stands beside it."""
    return RUNNABLE


def cache_key(parts: dict[str, Any]) -> str:
    text = json.dumps(parts, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def make_job(query: SelectQuery, workers: WorkerPool) -> Job:
    """The measurement a query asks for, on which worker, under which key."""
    options = query.measure or MeasureOptions()
    index = options.worker_index
    choice = query.platform
    if choice is not None and choice.worker_index is not None:
        index = choice.worker_index if index is None else index
    elif choice is not None or query.spec.get("platform") is not None:
        raise InvalidSpecError.single(
            "policy",
            "MEASURED times backends on a serving worker: leave the platform to the worker "
            "(no preset, profile or platform in the spec)",
        )
    index = 0 if index is None else index
    snapshot = workers.worker(index).snapshot()
    if snapshot.profile is None:
        raise WorkerUnavailableError(f"worker {index} is not ready to measure")
    deployment = parse_deployment(dict(query.spec), default_platform=snapshot.profile)
    source = source_spec(deployment.hf_quantization_config, quantization=deployment.quantization)
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
    backends = usable_backends()
    parts = {
        "device": snapshot.device_name,
        "platform": {k: profile.get(k) for k in ("device", "capability", "arch", "packages")},
        "torch": snapshot.torch_version,
        "service": __version__,
        "shape": shape,
        "quantization": source.to_json(),
        "backends": list(backends),
    }
    request = MeasureBackends(shape, source, tuple(backends), token_counts=())
    return Job(
        index, cache_key(parts), parts, request, token_counts(options.token_counts), backends
    )


# ---------------------------------------------------------------------------------------
# The answer


def summarize(job: Job, entry: dict[str, Any], static: str) -> MeasuredSelection:
    """The measured part from a cache entry, for the job's token counts."""
    oldest = None
    buckets = []
    for count in job.tokens:
        bucket = entry["buckets"][str(count)]
        oldest = bucket["time"] if oldest is None else min(oldest, bucket["time"])
        timings = []
        best: tuple[float, str] | None = None
        static_seconds = None
        for timing in bucket["timings"]:
            seconds = timing.get("seconds")
            timings.append(Timing(timing["backend"], timing.get("error", ""), seconds))
            if seconds is None:
                continue
            if best is None or seconds < best[0]:
                best = (seconds, timing["backend"])
            if timing["backend"] == static:
                static_seconds = seconds
        speedup = None
        if best is not None and static_seconds is not None and best[0] > 0:
            speedup = static_seconds / best[0]
        buckets.append(Bucket(count, static, tuple(timings), static_seconds, best, speedup))
    return MeasuredSelection(
        worker_index=job.worker_index,
        device_name=str(entry.get("device_name", job.parts.get("device", ""))),
        versions=dict(entry.get("versions") or {}),
        buckets=tuple(buckets),
        measured_time=oldest,
    )


# ---------------------------------------------------------------------------------------
# The policy


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

    async def answer(
        self, selector: Selector, query: SelectQuery
    ) -> tuple[SelectAnswer, Callable[[], None]]:
        """The measured answer and how to count its static decision again."""
        options = query.measure or MeasureOptions()
        if options.worker_index is not None and query.platform is None:
            # decide for the worker that measures (the default would be worker 0's platform)
            query = dataclasses.replace(
                query, platform=PlatformChoice(worker_index=options.worker_index)
            )
        recount: Callable[[], None]
        try:
            answer, counters = selector.decide(query)  # counted as always

            def recount() -> None:
                for counter in counters:
                    counter.inc()

        except SelectionError as exc:
            answer = SelectAnswer(exc.ruleset or DEFAULT_RULESET, failure=exc)
            failure = exc

            def recount() -> None:
                selector.count_failure(failure)

        job = make_job(query, self._workers)
        started = time.perf_counter()
        entry = self.store.get(job.key)
        missing = [t for t in job.tokens if options.refresh or not _has(entry, t)]
        if missing:
            async with self._lock:
                entry = self.store.get(job.key)  # another request may have measured them
                missing = [t for t in job.tokens if options.refresh or not _has(entry, t)]
                if missing:
                    entry = await self._measure(job, entry, missing)
        assert entry is not None
        decision = answer.decision
        static = (decision.backend or "") if decision is not None else ""
        measured = dataclasses.replace(
            summarize(job, entry, static),
            from_cache=not missing,
            measure_seconds=time.perf_counter() - started if missing else 0.0,
        )
        return dataclasses.replace(answer, measured=measured), recount

    async def _measure(
        self, job: Job, entry: dict[str, Any] | None, tokens: list[int]
    ) -> dict[str, Any]:
        worker = self._workers.worker(job.worker_index)
        request = dataclasses.replace(
            job.request, token_counts=tuple(tokens), budget_s=self.budget_s
        )
        try:
            answer = await worker.call(request, timeout=self.timeout_s)
        except WorkerCallError as exc:
            raise run_error(exc) from exc
        entry = dict(entry or {"parts": job.parts, "buckets": {}})
        entry["device_name"] = answer.device_name
        entry["versions"] = dict(answer.versions)
        now = time.time()
        buckets = dict(entry.get("buckets") or {})
        for count in tokens:
            timings = []
            for result in answer.results:
                seconds = result.seconds.get(str(count))
                timings.append(
                    {"backend": result.backend, "seconds": seconds, "error": result.error}
                )
            buckets[str(count)] = {"time": now, "timings": timings}
        entry["buckets"] = buckets
        self.store.put(job.key, entry)
        return entry


def _has(entry: dict[str, Any] | None, tokens: int) -> bool:
    return entry is not None and str(tokens) in (entry.get("buckets") or {})
