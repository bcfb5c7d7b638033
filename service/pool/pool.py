"""Every worker of the server, and where work and kept layers go among them.

With several workers (one per GPU), the pool places work and remembers where each kept
layer lives:

* Readiness: the pool is ready while at least one worker is (a node with one GPU down still
  serves on the others; a call that names the down worker gets UNAVAILABLE). `all_ready`
  says whether every one is.
* Placement (`place`): a named worker index wins; otherwise the ready worker holding the
  fewest bytes of kept layers, then the one with the fewest calls in flight, ties taken in
  turn (round robin), so layers and load spread over the GPUs.
* Layers: the directory (`layers.LayerDirectory`) maps each kept layer to its worker's
  incarnation; a worker that restarts loses its own layers only.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from service.ipc.messages import ListLayers, UnloadLayer
from service.oracle import PlatformProfile
from service.pool.config import SupervisorConfig
from service.pool.errors import (
    LayerLostError,
    LayerNotFoundError,
    WorkerNotFoundError,
    WorkerUnavailableError,
)
from service.pool.handle import WorkerHandle, WorkerSnapshot, WorkerState
from service.pool.layers import LayerDirectory, LayerPlace

#: ListWorkers waits this long for a worker's layer list (a hung worker shows none; the
#: supervisor's ping restarts it).
DESCRIBE_TIMEOUT_S = 5.0


class WorkerPool:
    """Every worker of the server, by index; where each kept layer lives."""

    def __init__(
        self,
        devices: Sequence[str],
        config: SupervisorConfig,
        on_change: Callable[[WorkerHandle], None] | None = None,
    ) -> None:
        if not devices:
            raise ValueError("a worker pool needs at least one device")
        self._on_change = on_change
        self.workers = [
            WorkerHandle(i, device, config, self._changed) for i, device in enumerate(devices)
        ]
        self._ready_event = asyncio.Event()
        #: Moves on at every worker change, so answers derived from the workers' profiles
        #: (cached SelectBackend answers) know when they may be stale.
        self.generation = 0
        #: The layer budget each worker holds kept layers to (shown by `describe`; the
        #: conversion calls carry it to the workers). Set by the servicer from settings.
        self.layer_budget_bytes = 0
        self._layers = LayerDirectory()
        self._turn = 0

    def _changed(self, worker: WorkerHandle) -> None:
        self.generation += 1
        if worker.state is WorkerState.RESTARTING:
            self._layers.lose(worker.index, worker.device, worker.last_exit_reason)
        if self.ready:
            self._ready_event.set()
        else:
            self._ready_event.clear()
        if self._on_change is not None:
            self._on_change(worker)

    def start(self) -> None:
        for worker in self.workers:
            worker.start()

    async def stop(self) -> None:
        await asyncio.gather(*(w.stop() for w in self.workers))

    async def wait_ready(self, timeout: float | None = None) -> bool:
        """Until at least one worker is ready (False on timeout)."""
        try:
            await asyncio.wait_for(self._ready_event.wait(), timeout)
        except TimeoutError:
            return False
        return True

    @property
    def ready(self) -> bool:
        """At least one worker is ready: the server's readiness. A node keeps serving on
        its healthy GPUs while one worker restarts; calls for the restarting one (named by
        index, or holding the layer) get UNAVAILABLE or NOT_FOUND meanwhile."""
        return any(w.ready for w in self.workers)

    @property
    def all_ready(self) -> bool:
        return all(w.ready for w in self.workers)

    def ready_workers(self) -> list[WorkerHandle]:
        return [w for w in self.workers if w.ready]

    def worker(self, index: int) -> WorkerHandle:
        if not 0 <= index < len(self.workers):
            raise WorkerNotFoundError(index, len(self.workers))
        return self.workers[index]

    def profile(self, index: int) -> PlatformProfile:
        """The platform a ready worker reported."""
        worker = self.worker(index)
        if not worker.ready or worker.profile is None:
            raise WorkerUnavailableError(
                f"worker {index} ({worker.device}) is {worker.state}; its platform is not known "
                "until it is ready (name a preset or a platform for a what-if answer)"
            )
        return worker.profile

    def default_profile(self) -> PlatformProfile | None:
        """The first ready worker's platform (worker 0's while it is up), else None."""
        for worker in self.workers:
            if worker.ready and worker.profile is not None:
                return worker.profile
        return None

    def snapshots(self) -> list[WorkerSnapshot]:
        return [w.snapshot() for w in self.workers]

    async def describe(self) -> list[WorkerSnapshot]:
        """Snapshots with each ready worker's kept layers (ids, bytes) and the budget."""
        held = await asyncio.gather(
            *(self._held(w, timeout=DESCRIBE_TIMEOUT_S) for w in self.workers),
            return_exceptions=True,
        )
        out = []
        for worker, layers in zip(self.workers, held, strict=True):
            listed = layers if isinstance(layers, list) else []
            out.append(
                dataclasses.replace(
                    worker.snapshot(),
                    layer_bytes=sum(int(layer.get("byte_size", 0)) for layer in listed),
                    layer_budget_bytes=self.layer_budget_bytes,
                    layer_ids=tuple(str(layer.get("layer_id", "")) for layer in listed),
                )
            )
        return out

    async def _held(
        self, worker: WorkerHandle, *, timeout: float | None = None
    ) -> list[dict[str, Any]]:
        """The layers a worker lists (empty while it is not ready); prunes the directory
        of this worker's ids it no longer holds (evicted to make room)."""
        if not worker.ready:
            return []
        incarnation = worker.incarnation
        answer = await worker.call(ListLayers(), timeout=timeout)
        layers = [dict(layer) for layer in answer.layers]
        if worker.incarnation == incarnation:
            self._layers.listed(worker.index, incarnation, layers)
        return layers

    async def list_layers(self, index: int | None = None) -> list[dict[str, Any]]:
        targets = self.workers if index is None else [self.worker(index)]
        layers: list[dict[str, Any]] = []
        for worker in targets:
            for layer in await self._held(worker):
                layers.append({**layer, "worker_index": worker.index})
        return layers

    # -- placement and the layer directory

    def place(self, index: int | None = None, *, by_memory: bool = False) -> WorkerHandle:
        """The worker a new piece of work goes to: worker `index` when one is named;
        otherwise a ready worker, the one holding the fewest kept-layer bytes first when
        `by_memory` (a layer to keep), then the one with the fewest calls in flight, ties
        taken in turn. No ready worker: WorkerUnavailableError."""
        if index is not None:
            return self.worker(index)
        ready = self.ready_workers()
        if not ready:
            raise WorkerUnavailableError("no worker is ready")
        held = self.held_bytes() if by_memory else {}
        count = len(self.workers)
        turn = self._turn
        self._turn += 1
        return min(
            ready,
            key=lambda w: (held.get(w.index, 0), w.busy, (w.index - turn) % count),
        )

    def held_bytes(self) -> dict[int, int]:
        """Kept-layer bytes by worker index, as the directory knows them."""
        return self._layers.held_bytes()

    def remember(self, layer_id: str, worker: WorkerHandle, byte_size: int = 0) -> None:
        """A layer `worker` keeps from now on (ConvertWeights with keep_loaded)."""
        self._layers.remember(layer_id, LayerPlace(worker.index, worker.incarnation, byte_size))

    def forget(self, layer_id: str) -> None:
        self._layers.forget(layer_id)

    async def holder(self, layer_id: str) -> WorkerHandle:
        """The worker that holds `layer_id`. A layer its worker lost in a restart is
        LayerLostError; one no worker has is LayerNotFoundError. The directory answers
        without a call; a layer it does not know is looked for on every ready worker."""
        place = self._layers.place(layer_id)
        if place is not None:
            worker = self.workers[place.worker]
            if worker.incarnation == place.incarnation:
                return worker
            self._layers.forget(layer_id)
            raise LayerLostError(layer_id, worker.index, worker.device, worker.last_exit_reason)
        lost = self._layers.lost(layer_id)
        if lost is not None:
            raise lost
        for layer in await self.list_layers():
            if layer.get("layer_id") == layer_id:
                return self.workers[int(layer["worker_index"])]
        raise LayerNotFoundError(layer_id)

    async def unload_layer(self, layer_id: str) -> int:
        """Drop a converted layer from the worker that holds it; returns the bytes freed."""
        worker = await self.holder(layer_id)
        answer = await worker.call(UnloadLayer(layer_id))
        self.forget(layer_id)
        if not answer.found:
            raise LayerNotFoundError(layer_id)
        return answer.freed_bytes
