"""service.dataplane.offload: a job runs on a pool thread while the loop goes on, its budget
counts from when it was handed over, a spent budget stops it with BudgetExceededError, and
the GIL switch interval is short only while a job runs."""

from __future__ import annotations

import asyncio
import sys
import threading

import pytest

from service.dataplane.errors import BudgetExceededError
from service.dataplane.offload import BUDGET_SETTING, SWITCH_INTERVAL_S, Budget, Offload


def test_a_job_runs_off_the_loop_while_the_loop_answers() -> None:
    offload = Offload(threads=1, budget_s=30.0)
    release = threading.Event()
    seen: dict[str, object] = {}

    def job(budget: Budget) -> str:
        seen["thread"] = threading.current_thread().name
        seen["interval"] = sys.getswitchinterval()
        release.wait(30)
        return "done"

    async def main() -> tuple[str, int]:
        task = asyncio.ensure_future(offload.run(job))
        ticks = 0
        while not release.is_set():  # the loop keeps running while the job waits
            await asyncio.sleep(0)
            ticks += 1
            if ticks == 100:
                release.set()
        return await task, ticks

    before = sys.getswitchinterval()
    result, ticks = asyncio.run(main())
    assert (result, ticks) == ("done", 100)
    assert str(seen["thread"]).startswith("offload")
    assert seen["interval"] == SWITCH_INTERVAL_S
    assert sys.getswitchinterval() == before
    offload.close()


def test_a_spent_budget_stops_the_job_with_the_setting_named() -> None:
    offload = Offload(threads=1, budget_s=30.0)

    def job(budget: Budget) -> None:
        budget.check("the diff")

    with pytest.raises(BudgetExceededError) as stopped:
        asyncio.run(offload.run(job, Budget(0.0)))
    assert stopped.value.setting == BUDGET_SETTING
    assert str(stopped.value).startswith("the diff was not done within 0 s")
    offload.close()


def test_the_callers_shorter_deadline_wins() -> None:
    offload = Offload(threads=1, budget_s=30.0)
    assert offload.budget(2.0).seconds == 2.0
    assert offload.budget(60.0).seconds == 30.0
    assert offload.budget(None).seconds == 30.0
    assert offload.budget(-1.0).spent
    offload.close()
