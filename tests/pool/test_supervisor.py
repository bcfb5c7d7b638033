"""The supervisor: real worker processes, killed and restarted."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Callable

import pytest

from service.ipc.messages import Ping
from service.pool.config import SupervisorConfig
from service.pool.devices import discover_devices
from service.pool.errors import WorkerNotFoundError, WorkerUnavailableError
from service.pool.handle import WorkerHandle, WorkerState
from service.pool.pool import WorkerPool

#: Quick pings and restarts, but a ping timeout no loaded machine reaches by accident (a
#: worker busy importing torch on a shared core can take seconds to answer).
FAST = SupervisorConfig(ping_interval_s=0.2, ping_timeout_s=30.0, restart_backoff_s=0.05)
#: For the hung-worker test only: a stopped worker is declared hung after this long.
HUNG = SupervisorConfig(ping_interval_s=0.2, ping_timeout_s=3.0, restart_backoff_s=0.05)


async def until(predicate: Callable[[], bool], timeout: float = 120.0) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.02)
    return True


def test_pool_starts_restarts_and_stops() -> None:
    async def scenario() -> None:
        changes: list[tuple[int, WorkerState, int]] = []

        def changed(worker: WorkerHandle) -> None:
            changes.append((worker.index, worker.state, worker.restarts))

        pool = WorkerPool(["cpu"], FAST, on_change=changed)
        pool.start()
        try:
            assert await pool.wait_ready(120)
            profile = pool.profile(0)
            assert profile.device == "cpu"
            assert pool.default_profile() == profile
            first = pool.snapshots()[0]
            assert (await pool.workers[0].call(Ping())).pid == first.pid

            os.kill(first.pid, signal.SIGKILL)
            assert await until(lambda: pool.snapshots()[0].restarts == 1)
            assert await pool.wait_ready(120)
            second = pool.snapshots()[0]
            assert second.restarts == 1
            assert second.pid != first.pid
            # The supervisor lets asyncio reap the child (a kill() first would reap it in
            # Popen.poll() and lose the status to a blind 255), so the reason is exact.
            assert "SIGKILL" in second.last_exit_reason
            assert (0, WorkerState.RESTARTING, 1) in changes
            with pytest.raises(WorkerNotFoundError):
                pool.profile(4)
        finally:
            await pool.stop()
        assert pool.snapshots()[0].state is WorkerState.STOPPED
        with pytest.raises(WorkerUnavailableError):
            pool.profile(0)

    asyncio.run(scenario())


def test_a_hung_worker_is_killed_and_restarted() -> None:
    async def scenario() -> None:
        pool = WorkerPool(["cpu"], HUNG)
        pool.start()
        try:
            assert await pool.wait_ready(120)
            first = pool.snapshots()[0]
            os.kill(first.pid, signal.SIGSTOP)  # alive, but answers nothing
            assert await until(lambda: pool.snapshots()[0].pid != first.pid)
            assert await pool.wait_ready(120)
            second = pool.snapshots()[0]
            assert second.restarts > first.restarts
            assert "no answer to a ping" in second.last_exit_reason
        finally:
            await pool.stop()

    asyncio.run(scenario())


def test_device_lists() -> None:
    assert asyncio.run(discover_devices("cpu")) == ["cpu"]
    assert asyncio.run(discover_devices("cuda:0, cuda:1")) == ["cuda:0", "cuda:1"]
    with pytest.raises(ValueError, match="devices"):
        asyncio.run(discover_devices("gpu0"))
