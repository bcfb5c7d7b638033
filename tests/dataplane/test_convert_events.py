"""The progress events of a worker call, as a conversion streams them: every event in
order, and a caller that cancels mid-stream leaves no task pending (asyncio would report
one at error level, "Task was destroyed but it is pending!", when it is collected)."""

from __future__ import annotations

import asyncio
import gc
import logging
from typing import Any

import pytest

from service.dataplane.convert import _until_done


async def _events_of(count: int) -> list[dict[str, Any]]:
    events: asyncio.Queue[dict[str, Any]] = asyncio.Queue()

    async def call() -> None:
        for number in range(count):
            events.put_nowait({"n": number})
            await asyncio.sleep(0)

    task = asyncio.create_task(call())
    return [event async for event in _until_done(task, events)]


def test_every_event_in_order_then_the_end() -> None:
    assert asyncio.run(_events_of(50)) == [{"n": n} for n in range(50)]


def test_a_cancelled_caller_leaves_no_task_pending(caplog: pytest.LogCaptureFixture) -> None:
    async def main() -> list[asyncio.Task[Any]]:
        events: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        never: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        call = asyncio.create_task(asyncio.wait_for(never, None))
        seen = asyncio.Event()

        async def consume() -> None:
            async for _ in _until_done(call, events):
                seen.set()

        consumer = asyncio.create_task(consume())
        events.put_nowait({"n": 0})
        await seen.wait()  # the consumer waits for the next event now
        consumer.cancel()
        with pytest.raises(asyncio.CancelledError):
            await consumer
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
        return [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]

    with caplog.at_level(logging.ERROR, logger="asyncio"):
        assert asyncio.run(main()) == []
        gc.collect()
    assert [r.getMessage() for r in caplog.records if r.name == "asyncio"] == []
