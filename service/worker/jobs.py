"""Background calls of a worker: conversions that run for seconds to minutes.

The worker answers pings while a conversion runs (the supervisor kills a worker silent for
30 s), so a long call runs in a thread of its own and answers when done; meanwhile it may
send progress events. `cancel` sets the job's flag; the job checks it between tensors and
layers (`JobContext.check`), removes what it made and ends with `ConvertCancelledError`.

Errors cross the pipe as a type name, a message and `details` that let the server rebuild
the domain error: the category (which status code) and the field. The category is looked
up by the exception's class names (walking its MRO), so this module imports no domain code.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from service.formats.input_errors import ConvertCancelledError
from service.worker import protocol

log = logging.getLogger("moe_control.worker")

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


Handler = Callable[[dict[str, Any], JobContext], dict[str, Any]]


class Jobs:
    """The background calls in flight, by call id."""

    def __init__(self, send: Callable[[bytes], None]) -> None:
        self._send = send
        self._lock = threading.Lock()
        self._running: dict[int, tuple[JobContext, threading.Thread]] = {}

    def start(self, call_id: int, method: str, handler: Handler, params: dict[str, Any]) -> None:
        context = JobContext(call_id, self._send)
        thread = threading.Thread(
            target=self._run,
            args=(context, method, handler, params),
            name=f"job-{method}-{call_id}",
            daemon=True,
        )
        with self._lock:
            self._running[call_id] = (context, thread)
        thread.start()

    def _run(
        self, context: JobContext, method: str, handler: Handler, params: dict[str, Any]
    ) -> None:
        try:
            answer = protocol.result(context.call_id, handler(params, context))
        except BaseException as exc:
            kind, message, details = describe(exc)
            if details["category"] == "internal":
                log.exception("background call %s failed", method)
            answer = protocol.error(context.call_id, kind, message, details)
        finally:
            with self._lock:
                self._running.pop(context.call_id, None)
        try:
            self._send(answer)
        except (OSError, ValueError):  # the server went away meanwhile
            log.warning("could not answer background call %s", method)

    def cancel(self, call_id: int) -> bool:
        with self._lock:
            entry = self._running.get(call_id)
        if entry is None:
            return False
        entry[0].cancel_event.set()
        return True

    def cancel_all(self, wait_s: float = 5.0) -> None:
        with self._lock:
            entries = list(self._running.values())
        for context, _ in entries:
            context.cancel_event.set()
        for _, thread in entries:
            thread.join(wait_s)

    @property
    def active(self) -> int:
        with self._lock:
            return len(self._running)
