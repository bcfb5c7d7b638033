"""The pool with two real CPU workers: readiness while any is ready, placement, the layer
directory, and a restart that loses only the restarted worker's layers."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from pool.test_supervisor import until
from service.pool.config import SupervisorConfig
from service.pool.devices import discover_devices
from service.pool.errors import (
    LayerLostError,
    LayerNotFoundError,
    WorkerNotFoundError,
    WorkerUnavailableError,
)
from service.pool.handle import WorkerState
from service.pool.pool import WorkerPool

FAST = SupervisorConfig(ping_interval_s=0.2, ping_timeout_s=30.0, restart_backoff_s=0.3)


def test_cpu_workers_multiply_the_cpu_only() -> None:
    assert asyncio.run(discover_devices("cpu", cpu_workers=3)) == ["cpu", "cpu", "cpu"]
    assert asyncio.run(discover_devices("cpu")) == ["cpu"]
    assert asyncio.run(discover_devices("cuda:0,cuda:1", cpu_workers=3)) == ["cuda:0", "cuda:1"]


def test_two_workers_place_route_and_lose_only_their_own_layers() -> None:
    async def scenario() -> None:
        pool = WorkerPool(["cpu", "cpu"], FAST)
        with pytest.raises(WorkerUnavailableError, match="no worker is ready"):
            pool.place()
        pool.start()
        try:
            assert await until(lambda: pool.all_ready)
            assert pool.ready
            # Nothing kept and nothing in flight: ties rotate over the workers.
            assert {pool.place().index for _ in range(4)} == {0, 1}
            assert pool.place(1).index == 1
            with pytest.raises(WorkerNotFoundError):
                pool.place(2)
            # By memory: the worker with fewer kept-layer bytes, whatever the turn.
            pool.remember("big", pool.workers[0], 1000)
            assert [pool.place(by_memory=True).index for _ in range(3)] == [1, 1, 1]
            pool.remember("small", pool.workers[1], 10)
            assert pool.held_bytes() == {0: 1000, 1: 10}
            assert (await pool.holder("big")).index == 0
            assert (await pool.holder("small")).index == 1

            victim = pool.snapshots()[1]
            os.kill(victim.pid, signal.SIGKILL)
            assert await until(lambda: pool.workers[1].state is WorkerState.RESTARTING)
            # One worker restarting: the pool (the server's readiness) stays ready, places
            # new work on the other, and its own layers are gone.
            assert pool.ready and not pool.all_ready
            assert {pool.place().index for _ in range(3)} == {0}
            with pytest.raises(LayerLostError) as lost:
                await pool.holder("small")
            message = str(lost.value)
            assert "'small'" in message and "worker 1 (cpu)" in message
            assert "SIGKILL" in message
            assert (await pool.holder("big")).index == 0
            assert pool.held_bytes() == {0: 1000}
            described = await pool.describe()  # the restarting worker lists nothing
            assert [(s.index, s.layer_ids, s.layer_bytes) for s in described] == [
                (0, (), 0),
                (1, (), 0),
            ]
            # An id the directory does not know is looked for on every worker (a listing,
            # which also prunes ids a worker no longer holds: "big" was never really loaded
            # there, and the worker's store is the truth).
            with pytest.raises(LayerNotFoundError) as unknown:
                await pool.holder("never-loaded")
            assert not isinstance(unknown.value, LayerLostError)
            assert pool.held_bytes() == {}
        finally:
            await pool.stop()
        assert not pool.ready

    asyncio.run(scenario())
