"""CPU-heavy work off the event loop: a bounded pool of threads, a time budget per job.

A server process answers every call on one event loop; a request that decides for seconds
on it (a matrix of thousands of cells, the what-would-change search, a huge spec) would
keep health checks, readiness probes and every other call of that process waiting. Such
work runs here instead: `Offload.run` hands it to one of `threads` threads and awaits it,
so the loop goes on answering meanwhile; more jobs than threads wait their turn (the
per-method concurrency limits bound how many).

Threads, not processes: the work reads the process's selector, answer cache and metrics,
which a process pool would have to copy out and merge back, and the GIL is handed to the
loop's thread at every switch interval, which `Offload` shortens while a job runs
(bench/RESULTS.md, "A loop that never stalls", has both measured).

A job gets a `Budget`: the smaller of the server's `--cpu-budget-s` and the caller's own
deadline, counted from when the job was handed over (waiting for a thread included).
The work checks it between steps (a matrix between cells) and stops with
BudgetExceededError (DEADLINE_EXCEEDED, HTTP 504), or, for a matrix, says which cells it
did not reach.
"""

from __future__ import annotations

import asyncio
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from service.dataplane.errors import BudgetExceededError
from service.settings import CPU_BUDGET_S, Settings

T = TypeVar("T")

#: The GIL switch interval while a job runs: how long the loop's thread may wait for the
#: GIL at each of its wake-ups (Python's default is 5 ms).
SWITCH_INTERVAL_S = 0.0005
#: The setting that bounds every job.
BUDGET_SETTING = "--cpu-budget-s"


class Budget:
    """The time a job may take, from `start` (time.monotonic)."""

    __slots__ = ("deadline", "seconds")

    def __init__(self, seconds: float, start: float | None = None) -> None:
        self.seconds = seconds
        self.deadline = (time.monotonic() if start is None else start) + seconds

    @property
    def spent(self) -> bool:
        return time.monotonic() >= self.deadline

    def check(self, what: str) -> None:
        """BudgetExceededError once the budget is spent."""
        if self.spent:
            raise BudgetExceededError(what, self.seconds, BUDGET_SETTING)


class Offload:
    """A pool of `threads` threads for CPU-heavy jobs, each within `budget_s` seconds."""

    def __init__(self, threads: int = 1, budget_s: float = CPU_BUDGET_S) -> None:
        self.threads = threads
        self.budget_s = budget_s
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="offload")
        self._running = 0
        self._lock = threading.Lock()
        self._interval = sys.getswitchinterval()

    @classmethod
    def from_settings(cls, settings: Settings) -> Offload:
        return cls(settings.cpu_threads, settings.cpu_budget_s)

    def budget(self, deadline_s: float | None = None) -> Budget:
        """A budget from now: `budget_s`, or the caller's remaining time if shorter."""
        seconds = self.budget_s if deadline_s is None else min(self.budget_s, deadline_s)
        return Budget(max(seconds, 0.0))

    async def run(self, job: Callable[[Budget], T], budget: Budget | None = None) -> T:
        """`job(budget)` on a thread of the pool; its result, or what it raised."""
        budget = self.budget() if budget is None else budget
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, self._call, job, budget)

    def _call(self, job: Callable[[Budget], T], budget: Budget) -> T:
        self._enter()
        try:
            return job(budget)
        finally:
            self._leave()

    def _enter(self) -> None:
        with self._lock:
            self._running += 1
            if self._running == 1:
                sys.setswitchinterval(SWITCH_INTERVAL_S)

    def _leave(self) -> None:
        with self._lock:
            self._running -= 1
            if self._running == 0:
                sys.setswitchinterval(self._interval)

    def close(self) -> None:
        """Drop the jobs still waiting for a thread (the server is stopping: their calls
        are gone); a running one ends at its budget."""
        self._pool.shutdown(wait=False, cancel_futures=True)
