"""Kept job threads (jobs.py): a call goes to a waiting thread of its request class instead
of a thread started for it, calls of one class still run side by side, and shutdown ends
them all."""

from __future__ import annotations

import queue
import threading
import time
from typing import Any

from service.ipc import protocol
from service.worker import jobs


class Answers:
    """What the jobs send, decoded, by call id."""

    def __init__(self) -> None:
        self.queue: queue.Queue[dict[str, Any]] = queue.Queue()

    def __call__(self, line: bytes) -> None:
        self.queue.put(protocol.decode(line))

    def get(self, timeout: float = 10.0) -> dict[str, Any]:
        return self.queue.get(timeout=timeout)


def thread_name(values: dict[str, Any], context: jobs.JobContext) -> dict[str, Any]:
    return {"thread": threading.current_thread().name}


def wait_until(condition: Any, timeout: float = 60.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.01)
    return False


def test_calls_one_after_another_reuse_one_thread_per_class() -> None:
    answers = Answers()
    runner = jobs.Jobs(answers)
    names = {"run": set(), "convert": set()}
    for call_id in range(1, 21):
        kind = "run" if call_id % 2 else "convert"
        runner.start(call_id, "m", thread_name, {}, kind=kind)
        answer = answers.get()
        assert answer["id"] == call_id
        names[kind].add(answer["result"]["thread"])
    assert [len(found) for found in names.values()] == [1, 1]
    assert names["run"] != names["convert"]
    assert wait_until(lambda: runner.active == 0)
    assert runner.threads == {"run": 1, "convert": 1}
    runner.cancel_all(wait_s=5)
    assert runner.threads == {"run": 0, "convert": 0}


def test_calls_of_one_class_run_side_by_side_and_the_surplus_thread_ends() -> None:
    answers = Answers()
    runner = jobs.Jobs(answers, idle_s=0.2)
    release = threading.Event()
    both = threading.Barrier(2, timeout=10)

    def meet(values: dict[str, Any], context: jobs.JobContext) -> dict[str, Any]:
        both.wait()  # only returns once the other call runs too
        release.wait(10)
        return {"thread": threading.current_thread().name}

    runner.start(1, "m", meet, {}, kind="run")
    runner.start(2, "m", meet, {}, kind="run")
    assert wait_until(lambda: both.n_waiting == 0 and runner.threads["run"] == 2)
    release.set()
    threads = {answers.get()["result"]["thread"], answers.get()["result"]["thread"]}
    assert len(threads) == 2
    assert wait_until(lambda: runner.threads["run"] == 1)  # the second is idle, then gone
    runner.start(3, "m", thread_name, {}, kind="run")
    assert answers.get()["result"]["thread"] in threads
    runner.cancel_all(wait_s=5)


def test_cancel_all_stops_a_running_call_and_ends_the_threads() -> None:
    answers = Answers()
    runner = jobs.Jobs(answers)
    started = threading.Event()

    def slow(values: dict[str, Any], context: jobs.JobContext) -> dict[str, Any]:
        started.set()
        while True:
            context.check()
            context.cancel_event.wait(0.01)

    runner.start(5, "slow", slow, {}, kind="convert")
    assert started.wait(10)
    runner.cancel_all(wait_s=5)
    answer = answers.get()
    assert answer["id"] == 5 and answer["error"]["details"]["category"] == "cancelled"
    assert runner.threads == {"convert": 0} and runner.active == 0


def test_a_call_cancelled_before_its_thread_takes_it_never_runs() -> None:
    answers = Answers()
    runner = jobs.Jobs(answers)
    ran: list[int] = []
    context = jobs.JobContext(9, answers)
    context.cancel_event.set()
    runner._run(jobs._Job(context, "m", lambda values, ctx: ran.append(1) or {}, {}))
    answer = answers.get()
    assert answer["id"] == 9 and answer["error"]["details"]["category"] == "cancelled"
    assert ran == []
