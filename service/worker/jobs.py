"""Background calls of a worker: conversions that run for seconds to minutes.

The worker answers pings while a conversion runs (the supervisor kills a worker silent for
30 s), so a long call runs on a job thread and answers when done; meanwhile it may send
progress events. Job threads are kept per request class (`_Lane`), not started per call.
`cancel` sets the job's flag; the job checks it between tensors and layers
(`JobContext.check`), removes what it made and ends with `ConvertCancelledError`.

Errors cross the pipe as a type name, a message and `details` that let the server rebuild
the domain error: the category (which status code) and the field. The category is looked
up by the exception's class names (walking its MRO), so this module imports no domain code.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from service.formats.errors import ConvertCancelledError
from service.ipc import protocol

log = logging.getLogger("moe_control.worker")

#: A kept job thread beyond its class's first ends after this long without work.
IDLE_S = 30.0
#: The request class of a job started without one (streams.RUN, named here without torch).
DEFAULT_KIND = "run"

#: Exception class name -> category the server maps to a status code (first match in MRO).
CATEGORIES: dict[str, str] = {
    "ConvertCancelledError": "cancelled",
    "PermissionDeniedError": "permission_denied",
    "ConversionUnsupported": "unimplemented",
    "NotImplementedError": "unimplemented",
    "InvalidSpecError": "invalid_spec",
    "SelectionError": "failed_precondition",
    "ConvertInputError": "invalid_argument",
    "FormatError": "invalid_argument",
    "SegmentError": "resource_exhausted",
    "KernelInputError": "invalid_argument",
    "LayerMissingError": "not_found",
    "LayerBudgetError": "resource_exhausted",
    "KernelUnavailableError": "backend_unavailable",
}


def describe(exc: BaseException) -> tuple[str, str, dict[str, Any]]:
    """(type name, message, details) of an exception, for `protocol.error`."""
    category = next(
        (CATEGORIES[c.__name__] for c in type(exc).__mro__ if c.__name__ in CATEGORIES),
        "internal",
    )
    details: dict[str, Any] = {"category": category}
    for name in ("field", "path", "reason", "description"):
        value = getattr(exc, name, None)
        if isinstance(value, str):
            details[name] = value
    violations = getattr(exc, "violations", None)
    if violations:
        details["violations"] = [
            {"field": str(v.field), "description": str(v.description)} for v in violations
        ]
    to_json = getattr(exc, "to_json", None)
    if category == "failed_precondition" and callable(to_json):
        details["selection"] = to_json()
    return type(exc).__name__, str(exc), details


@dataclass
class JobContext:
    """What a background call sees of its environment."""

    call_id: int
    send: Callable[[bytes], None]
    cancel_event: threading.Event = field(default_factory=threading.Event)

    def emit(self, name: str, data: dict[str, Any]) -> None:
        self.send(protocol.event(self.call_id, name, data))

    @property
    def cancelled(self) -> bool:
        return self.cancel_event.is_set()

    def check(self) -> None:
        """Raise `ConvertCancelledError` once the call is cancelled."""
        if self.cancel_event.is_set():
            raise ConvertCancelledError(f"call {self.call_id} was cancelled")


#: Runs one background call: its decoded request (a `service.ipc.messages` request) and its
#: context in, its answer's JSON out.
Handler = Callable[[Any, JobContext], dict[str, Any]]


class _Job:
    """A background call waiting for (or running on) one of its lane's threads."""

    __slots__ = ("context", "handler", "method", "params")

    def __init__(self, context: JobContext, method: str, handler: Handler, params: object) -> None:
        self.context = context
        self.method = method
        self.handler = handler
        self.params = params


#: Put on a lane's queue to end one of its threads (at shutdown).
_STOP = None


class _Lane:
    """The kept threads of one request class.

    A thread started per call cost a clone, the new thread's first scheduling and the
    starter's wait for it (`Thread.start` blocks until the thread runs): on a loaded host
    those wake-ups were a large part of what the worker added to a 1 ms RunMoE. A lane keeps
    its threads: a call goes to an idle one through a queue (one wake-up). When every thread
    is busy a new one starts, so calls of a class still run side by side as before (a long
    conversion never queues behind another); threads beyond the first end after `idle_s`
    without work, so a burst leaves no crowd behind.
    """

    def __init__(self, name: str, run: Callable[[_Job], None], idle_s: float) -> None:
        self._name = name
        self._run = run
        self._idle_s = idle_s
        self._queue: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        #: Threads waiting on the queue less jobs queued for them (each put reserves one).
        self._idle = 0
        self._threads: set[threading.Thread] = set()
        self._started = 0

    def submit(self, job: _Job) -> None:
        with self._lock:
            if self._idle:
                self._idle -= 1
                self._queue.put(job)
                return
            self._started += 1
            thread = threading.Thread(
                target=self._loop,
                args=(job,),
                name=f"jobs-{self._name}-{self._started}",
                daemon=True,
            )
            self._threads.add(thread)
        thread.start()

    def _loop(self, job: _Job | None) -> None:
        try:
            while job is not None:
                self._run(job)
                job = self._next()
        finally:
            with self._lock:
                self._threads.discard(threading.current_thread())

    def _next(self) -> _Job | None:
        """The next job; None when this thread is to end (stopped, or surplus and idle)."""
        with self._lock:
            self._idle += 1
        while True:
            try:
                return self._queue.get(timeout=self._idle_s)
            except queue.Empty:
                with self._lock:
                    # Puts happen under the lock: an empty queue here means nobody has
                    # reserved this thread, so it may leave (but the lane keeps one).
                    if self._queue.empty() and len(self._threads) > 1:
                        self._idle -= 1
                        self._threads.discard(threading.current_thread())
                        return None

    def stop(self, wait_s: float) -> None:
        """End every thread once its current job is done (waits up to `wait_s` in all)."""
        with self._lock:
            threads = list(self._threads)
            for _ in threads:
                self._queue.put(_STOP)
            self._idle = 0
        deadline = time.monotonic() + wait_s
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))

    @property
    def threads(self) -> int:
        with self._lock:
            return len(self._threads)


class Jobs:
    """The background calls in flight, by call id, run on kept threads per request class."""

    def __init__(self, send: Callable[[bytes], None], *, idle_s: float = IDLE_S) -> None:
        self._send = send
        self._idle_s = idle_s
        self._lock = threading.Lock()
        self._running: dict[int, JobContext] = {}
        self._lanes: dict[str, _Lane] = {}

    def start(
        self,
        call_id: int,
        method: str,
        handler: Handler,
        params: object,
        *,
        kind: str = DEFAULT_KIND,
    ) -> None:
        """Run `handler` on a thread of request class `kind` (streams.py's classes)."""
        context = JobContext(call_id, self._send)
        with self._lock:
            self._running[call_id] = context
            lane = self._lanes.get(kind)
            if lane is None:
                lane = self._lanes[kind] = _Lane(kind, self._run, self._idle_s)
        try:
            lane.submit(_Job(context, method, handler, params))
        except BaseException:
            with self._lock:
                self._running.pop(call_id, None)
            raise

    def _run(self, job: _Job) -> None:
        context = job.context
        try:
            context.check()  # cancelled before a thread took it
            answer = protocol.result(context.call_id, job.handler(job.params, context))
        except BaseException as exc:
            kind, message, details = describe(exc)
            if details["category"] == "internal":
                log.exception("background call %s failed", job.method)
            answer = protocol.error(context.call_id, kind, message, details)
        finally:
            with self._lock:
                self._running.pop(context.call_id, None)
        try:
            self._send(answer)
        except (OSError, ValueError):  # the server went away meanwhile
            log.warning("could not answer background call %s", job.method)

    def cancel(self, call_id: int) -> bool:
        with self._lock:
            context = self._running.get(call_id)
        if context is None:
            return False
        context.cancel_event.set()
        return True

    def cancel_all(self, wait_s: float = 5.0) -> None:
        """Cancel every call and end the threads (waits up to `wait_s` for each class)."""
        with self._lock:
            contexts = list(self._running.values())
            lanes = list(self._lanes.values())
        for context in contexts:
            context.cancel_event.set()
        for lane in lanes:
            lane.stop(wait_s)

    @property
    def active(self) -> int:
        with self._lock:
            return len(self._running)

    @property
    def threads(self) -> dict[str, int]:
        """Kept threads by request class (for tests and logs)."""
        with self._lock:
            lanes = dict(self._lanes)
        return {kind: lane.threads for kind, lane in lanes.items()}
