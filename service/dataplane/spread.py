"""A whole-checkpoint conversion spread over every ready worker (one per GPU).

The checkpoint job already works in layer ranges (a Kubernetes Indexed Job runs one range
per pod over a shared journal; formats/checkpoint.py), so spreading it over the workers of
one server is cutting the job into ranges and handing them out as a work queue: each worker
pulls the next range when it finishes one, two ranges at a time (`RANGES_PER_WORKER`: one
converting while the other writes). Each worker reads its own layers straight from
the mapped shards, converts them on its device, hashes and writes their files and journal
records; the server only hands out ranges and merges the answers. The ranges, in order:

* the first starts where the job starts, with one layer only, since for a whole checkpoint
  it also owns the rest (the non-MoE tensors, the small files). It is handed out first,
  and the other workers start only once it reported (its output directory is prepared,
  so two workers never race to create it);
* the further MoE layers, one per range when a layer is large (`LARGE_LAYER_BYTES`: a
  layer then keeps a worker busy for a while, and a finer queue keeps every worker busy
  to the end), else about two ranges per worker (`chunk_size`);
* the source files' SHA-256s (the manifest's, a sequential stream per file) are handed
  out over the first ranges, largest file first to the least loaded range, so no single
  worker reads the whole checkpoint a second time (one worker hashing every shard is
  what the others would wait on; bench/RESULTS.md).

None of these ranges finalizes (`finalize: false`); once every range finished, one last
call of an empty range writes the index and the manifest from the journal records (and
hashes any source file still missing): exactly one run finalizes, once, with every record
in place, so the output is byte for byte what one worker writes
(tests/integration/test_multi_worker).

Where the output directory already holds a manifest (a re-run of a finished conversion:
verification only), the job runs whole on one worker. A worker that dies hands its range
back to the queue once (the journal makes a redone unit safe); all workers gone is
UNAVAILABLE.

Progress: the ranges' events are merged into one stream with the whole job's totals
(layers and bytes counted from the shard headers here, torch-free, as the job counts them);
each range's counts only grow, so the merged counts only grow, and a finished range counts
as complete. A layer's `converted` event carries its stage times (`stages`), passed on.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from service.formats.checkpoint.plan import (
    MANIFEST_NAME,
    CheckpointJob,
    find_moe_layers,
    shard_names,
)
from service.formats.io.safetensors import SafetensorsFile
from service.ipc.messages import MAX_LISTED_TENSORS, CheckpointConverted, ConvertCheckpoint
from service.pool.errors import WorkerUnavailableError
from service.pool.handle import WorkerHandle
from service.pool.pool import WorkerPool

#: How often one range may be handed to another worker after its worker died.
RETRIES_PER_RANGE = 1
#: Ranges one worker runs at once: while one range's layer is written and hashed (CPU),
#: the other's is read and converted (device), as a single run pipelines its own layers;
#: with ranges of one layer and one range at a time a worker would do one, then the other.
RANGES_PER_WORKER = 2
#: A layer at least this large is a range of its own (a Mixtral-8x7B GPTQ layer: 0.73 GB).
LARGE_LAYER_BYTES = 64 << 20

Emit = Callable[[dict[str, Any]], None]


@dataclass(frozen=True)
class SpreadPlan:
    """The job cut into layer ranges (the first owns the rest), then one finalizing call."""

    ranges: tuple[tuple[int, int], ...]
    #: Module names of the MoE layers converted (their tensors' name prefixes).
    modules: tuple[str, ...]
    layers_total: int
    bytes_total: int
    #: Per range, the source files whose SHA-256 it computes.
    hashes: tuple[tuple[str, ...], ...] = ()
    #: The finalizing call's empty range [end, end).
    end: int = 0
    #: The decoder layer index of each MoE layer converted.
    indices: tuple[int, ...] = ()

    def layers_in(self, number: int) -> int:
        """How many MoE layers range `number` converts (0 for the finalizing call)."""
        if number >= len(self.ranges):
            return 0
        start, end = self.ranges[number]
        return sum(start <= index < end for index in self.indices)

    def range_job(self, job_json: dict[str, Any], number: int) -> dict[str, Any]:
        """The job of range `number`; `len(ranges)` is the finalizing call."""
        if number == len(self.ranges):
            return {**job_json, "layers": [self.end, self.end], "finalize": True}
        hashes = self.hashes[number] if number < len(self.hashes) else ()
        return {
            **job_json,
            "layers": list(self.ranges[number]),
            "finalize": False,
            "hash_sources": list(hashes),
        }


def plan_spread(job: CheckpointJob, workers: int) -> SpreadPlan | None:
    """The ranges of `job` for `workers` workers, or None when it runs whole on one worker:
    fewer than two MoE layers in it, a re-run of a finished conversion, or a checkpoint
    this cannot read (the worker's run then reports the problem as it always does)."""
    try:
        return _plan(job, workers)
    except Exception:
        return None


def _plan(job: CheckpointJob, workers: int) -> SpreadPlan | None:
    names = shard_names(job.input_dir, job.root)
    files: dict[str, SafetensorsFile] = {}
    try:
        for name in names:
            path = job.root.child(job.input_dir, name, f"checkpoint.input_dir/{name}")
            files[name] = SafetensorsFile(path)
        layers, rest = find_moe_layers({name: list(f.entries) for name, f in files.items()})
        mine = [layer for layer in layers if job.wants(layer)]
        if len(mine) < 2 or (job.output_dir / MANIFEST_NAME).exists():
            return None
        sizes = [
            sum(files[t.file].entries[t.name].nbytes for t in layer.tensors.values())
            for layer in mine
        ]
        rest_bytes = sum(files[f].entries[n].nbytes for f in rest for n in rest[f])
        shard_bytes = {name: file.size for name, file in files.items()}
    finally:
        for file in files.values():
            file.close()
    bytes_total = sum(sizes) + (rest_bytes if job.owns_rest() else 0)
    start = job.layers[0] if job.layers is not None else 0
    end = job.layers[1] if job.layers is not None else mine[-1].index + 1
    large = min(sizes) >= LARGE_LAYER_BYTES
    # The first range carries the rest: one layer beside it.
    first = 1 if job.owns_rest() or large else chunk_size(len(mine), workers)
    body = mine[first:]
    step = 1 if large else chunk_size(len(body), workers)
    bounds = [start, *(body[i].index for i in range(0, len(body), step)), end]
    ranges = tuple(itertools.pairwise(bounds))
    loads = [0] * min(len(ranges), max(1, workers))
    loads[0] = rest_bytes if job.owns_rest() else 0
    hashes: list[list[str]] = [[] for _ in loads]
    if job.owns_rest():  # the range that owns the rest hashes the sources (as one run does)
        for name in sorted(shard_bytes, key=lambda n: (-shard_bytes[n], n)):
            least = loads.index(min(loads))
            hashes[least].append(name)
            loads[least] += shard_bytes[name]
    return SpreadPlan(
        ranges=ranges,
        modules=tuple(layer.module for layer in mine),
        layers_total=len(mine),
        bytes_total=bytes_total,
        hashes=tuple(tuple(sorted(h)) for h in hashes),
        end=end,
        indices=tuple(layer.index for layer in mine),
    )


def chunk_size(layers: int, workers: int) -> int:
    """Layers per range for small layers: about two ranges per worker. Within a range the
    job writes one layer while it converts the next and reads ahead, which a range of one
    layer cannot; more ranges than workers keeps them evenly busy when layers cost
    unevenly."""
    return max(1, -(-layers // (2 * max(1, workers))))


class _Merged:
    """The ranges' progress events as one stream with the whole job's totals."""

    def __init__(self, plan: SpreadPlan, emit: Emit) -> None:
        self.plan = plan
        self.emit = emit
        self.done: dict[int, tuple[int, int]] = {}
        self.totals: dict[int, tuple[int, int]] = {}

    def start(self) -> None:
        self._send({"stage": "planning", "current": ""})

    def update(self, number: int, data: dict[str, Any]) -> None:
        layers = int(data.get("layers_done", 0))
        nbytes = int(data.get("bytes_done", 0))
        if data.get("stage") == "planning":
            self.totals[number] = (
                int(data.get("layers_total", 0)),
                int(data.get("bytes_total", 0)),
            )
            return  # the merged stream announced the plan once already
        old = self.done.get(number, (0, 0))
        self.done[number] = (max(old[0], layers), max(old[1], nbytes))
        self._send(data)

    def finish(self, number: int) -> None:
        """A range ended: it counts as complete whatever its last event said."""
        if number in self.totals:
            self.done[number] = self.totals[number]

    def _send(self, data: dict[str, Any]) -> None:
        layers = sum(d[0] for d in self.done.values())
        nbytes = sum(d[1] for d in self.done.values())
        self.emit(
            {
                "stage": str(data.get("stage", "")),
                "current": str(data.get("current", "")),
                "layers_done": min(layers, self.plan.layers_total),
                "layers_total": self.plan.layers_total,
                "bytes_done": min(nbytes, self.plan.bytes_total),
                "bytes_total": self.plan.bytes_total,
            }
        )


@dataclass(frozen=True, slots=True)
class SpreadAnswer:
    """The ranges' answers merged into one, as one worker's would be, and where they ran."""

    converted: CheckpointConverted
    #: The worker index of each range, in range order (the finalizing call last).
    workers: tuple[int, ...]
    #: MoE layers converted per worker index.
    layers_by_worker: dict[str, int]


async def run_spread(
    pool: WorkerPool, job_json: dict[str, Any], plan: SpreadPlan, emit: Emit
) -> SpreadAnswer:
    """Run the plan's ranges on the pool's ready workers; returns their merged answer."""
    began = time.perf_counter()
    merged = _Merged(plan, emit)
    merged.start()
    queue: deque[int] = deque(range(len(plan.ranges)))
    answers: dict[int, CheckpointConverted] = {}
    ran_on: dict[int, int] = {}
    retries: dict[int, int] = {}
    prepared = asyncio.Event()

    async def run_range(worker: WorkerHandle, number: int) -> None:
        def heard(_name: str, data: dict[str, Any]) -> None:
            prepared.set()
            merged.update(number, data)

        answer = await worker.call(
            ConvertCheckpoint(plan.range_job(job_json, number)), on_event=heard
        )
        merged.finish(number)
        answers[number] = answer
        ran_on[number] = worker.index

    def give_back(number: int, error: WorkerUnavailableError) -> None:
        retries[number] = retries.get(number, 0) + 1
        if retries[number] > RETRIES_PER_RANGE:
            raise error
        queue.appendleft(number)

    #: Ranges running now; a worker with nothing to pull waits while any runs elsewhere,
    #: since a range whose worker dies comes back to the queue.
    running = 0
    changed = asyncio.Condition()

    def pullable() -> bool:
        return bool(queue) or running == 0

    async def pull(worker: WorkerHandle, first: bool) -> None:
        nonlocal running
        if not first:
            await prepared.wait()
        while worker.ready:
            async with changed:
                await changed.wait_for(pullable)
                if not queue:
                    return
                number = queue.popleft()
                running += 1
            try:
                await run_range(worker, number)
            except WorkerUnavailableError as exc:
                give_back(number, exc)
                return  # this worker is gone; the others take its range
            finally:
                if number == 0:
                    prepared.set()  # even when it failed: the others must not wait forever
                running -= 1
                async with changed:
                    changed.notify_all()

    ready = pool.ready_workers()
    pullers = [
        asyncio.create_task(pull(w, i == 0 and slot == 0))
        for slot in range(RANGES_PER_WORKER)
        for i, w in enumerate(ready)
    ]
    try:
        await asyncio.gather(*pullers)
        if queue:
            raise WorkerUnavailableError("every worker died during the conversion")
        last = len(plan.ranges)  # the finalizing call
        while last not in answers:
            worker = pool.place()
            try:
                await run_range(worker, last)
            except WorkerUnavailableError as exc:
                give_back(last, exc)
    finally:
        for task in pullers:
            task.cancel()
        for task in pullers:
            with contextlib.suppress(BaseException):
                await task
    return _merge(plan, [answers[i] for i in range(len(plan.ranges) + 1)], ran_on, began)


def _merge(
    plan: SpreadPlan, answers: list[CheckpointConverted], ran_on: dict[int, int], began: float
) -> SpreadAnswer:
    """The ranges' answers as one, tensors in the order one worker lists them: the MoE
    layers in layer order, then the copied tensors."""
    prefixes = tuple(f"{module}." for module in plan.modules)
    layer_tensors: list[dict[str, Any]] = []
    copied: list[dict[str, Any]] = []
    for answer in answers:
        for tensor in answer.tensors:
            (layer_tensors if str(tensor.get("name", "")).startswith(prefixes) else copied).append(
                tensor
            )
    tensors = layer_tensors + copied
    manifest = next((a.manifest_path for a in reversed(answers) if a.manifest_path), "")
    merged = CheckpointConverted(
        manifest_path=manifest,
        output_dir=answers[-1].output_dir,
        layers_total=sum(a.layers_total for a in answers),
        layers_converted=sum(a.layers_converted for a in answers),
        layers_skipped=sum(a.layers_skipped for a in answers),
        bytes_in=sum(a.bytes_in for a in answers),
        bytes_out=sum(a.bytes_out for a in answers),
        seconds=time.perf_counter() - began,
        device_seconds=sum(a.device_seconds for a in answers),
        stage_seconds=_sum_stages(answers),
        descriptor=next((a.descriptor for a in answers if a.descriptor), None),
        tensors=tuple(tensors[:MAX_LISTED_TENSORS]),
        tensors_total=sum(a.tensors_total for a in answers),
    )
    return SpreadAnswer(
        merged,
        tuple(ran_on[i] for i in range(len(answers))),
        _layers_by_worker(plan, ran_on),
    )


def _layers_by_worker(plan: SpreadPlan, ran_on: dict[int, int]) -> dict[str, int]:
    """MoE layers converted per worker index (a range that was redone counts where it
    finished)."""
    out: dict[str, int] = {}
    for number, worker in sorted(ran_on.items()):
        out[str(worker)] = out.get(str(worker), 0) + plan.layers_in(number)
    return out


def _sum_stages(answers: list[CheckpointConverted]) -> dict[str, float]:
    """The workers' seconds per stage, summed (worker time, not wall time)."""
    out: dict[str, float] = {}
    for answer in answers:
        for name, seconds in answer.stage_seconds.items():
            out[name] = out.get(name, 0.0) + seconds
    return out
