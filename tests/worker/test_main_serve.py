"""The worker's request loop (`main.serve`): a RUN-class call runs on the thread that read
it, while the other waiting threads still answer pings and cancels.

Why: the hand-over of every RunMoE from the reader to a job thread was one thread wake-up
on its path; running it where it was read removes that, and the other readers keep what
the supervisor relies on (a ping within its timeout, a cancel that reaches a running call,
the pipe's end cancelling what runs).
"""

from __future__ import annotations

import os
import threading
from typing import Any, BinaryIO

import pytest

from service.worker import jobs, main, protocol

STARTED = threading.Event()


def wait_for_cancel(
    worker: main.Worker, params: dict[str, Any], context: jobs.JobContext
) -> dict[str, Any]:
    """A RUN-class call that lasts until it is cancelled."""
    STARTED.set()
    context.cancel_event.wait(30)
    context.check()
    return {"thread": threading.current_thread().name}


def thread_name(
    worker: main.Worker, params: dict[str, Any], context: jobs.JobContext
) -> dict[str, Any]:
    return {"thread": threading.current_thread().name}


class Pipes:
    """`serve` on a thread, talking through real pipes."""

    def __init__(self) -> None:
        to_worker_r, self.to_worker = os.pipe()
        self.from_worker, from_worker_w = os.pipe()
        self.stdin: BinaryIO = os.fdopen(to_worker_r, "rb")
        self.stdout: BinaryIO = os.fdopen(from_worker_w, "wb")
        self.answers = os.fdopen(self.from_worker, "rb")
        self.result: list[int] = []
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()
        assert protocol.decode(self.answers.readline())["event"] == "hello"

    def _serve(self) -> None:
        self.result.append(main.serve("cpu", self.stdin, self.stdout))

    def send(self, call_id: int, method: str, params: dict[str, Any] | None = None) -> None:
        os.write(self.to_worker, protocol.request(call_id, method, params))

    def answer(self) -> dict[str, Any]:
        return protocol.decode(self.answers.readline())

    def close(self) -> int:
        os.close(self.to_worker)
        self.thread.join(30)
        self.stdin.close()
        self.stdout.close()
        self.answers.close()
        return self.result[0]


def test_pings_and_cancels_are_answered_while_a_run_call_runs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(main.BACKGROUND, "test_wait", f"{__name__}:wait_for_cancel")
    monkeypatch.setitem(main.BACKGROUND, "test_name", f"{__name__}:thread_name")
    STARTED.clear()
    pipes = Pipes()
    try:
        pipes.send(1, "test_wait")
        assert STARTED.wait(30)
        pipes.send(2, "ping")
        assert pipes.answer() == {"id": 2, "result": {"pid": os.getpid()}}
        pipes.send(3, "cancel", {"call_id": 1})
        assert pipes.answer() == {"id": 3, "result": {"cancelled": True}}
        cancelled = pipes.answer()
        assert cancelled["id"] == 1 and cancelled["error"]["details"]["category"] == "cancelled"
        # One call after another: run by the RUN-class threads that wait for requests (one
        # runs, another waits; no crowd of threads).
        names = set()
        for call_id in range(4, 10):
            pipes.send(call_id, "test_name")
            answer = pipes.answer()
            assert answer["id"] == call_id
            names.add(answer["result"]["thread"])
        assert 1 <= len(names) <= 2 and all(name.startswith("jobs-run-") for name in names)
    finally:
        assert pipes.close() == 0


def test_closing_the_pipe_cancels_a_running_call(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(main.BACKGROUND, "test_wait", f"{__name__}:wait_for_cancel")
    STARTED.clear()
    pipes = Pipes()
    pipes.send(1, "test_wait")
    assert STARTED.wait(30)
    os.close(pipes.to_worker)
    pipes.thread.join(30)
    assert not pipes.thread.is_alive() and pipes.result == [0]
    cancelled = pipes.answer()
    assert cancelled["id"] == 1 and cancelled["error"]["details"]["category"] == "cancelled"
    pipes.stdin.close()
    pipes.stdout.close()
    pipes.answers.close()
