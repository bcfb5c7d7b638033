"""The calls a worker has not answered yet, and where each answer line goes.

A call is a future waiting for its answer, perhaps a listener for its progress lines, and,
once its caller has left (cancelled, timed out) while the worker still runs it, the caller's
clean-up for the late answer. `InFlightCalls` keeps the three tables of one worker handle and
routes each decoded answer line to the one it belongs to.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from service.pool.errors import WorkerCallError

log = logging.getLogger("moe_control.supervisor")

#: Hears a call's progress lines: (event name, data).
Listener = Callable[[str, dict[str, Any]], None]
#: Gets an abandoned call's late answer (None: it failed, or the worker died).
OnAbandon = Callable[[dict[str, Any] | None], None]


class InFlightCalls:
    """One worker's calls in flight, by call id."""

    def __init__(self) -> None:
        self._pending: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self._listeners: dict[int, Listener] = {}
        #: Calls whose caller left while the worker still ran them: call id -> on_abandon.
        self._abandoned: dict[int, OnAbandon] = {}
        self._next_id = 0

    def next_id(self) -> int:
        """A call id not used before on this handle."""
        self._next_id += 1
        return self._next_id

    def open(self, call_id: int, on_event: Listener | None) -> asyncio.Future[dict[str, Any]]:
        """The future of a call about to be sent (and its listener, if any)."""
        future: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._pending[call_id] = future
        if on_event is not None:
            self._listeners[call_id] = on_event
        return future

    def close(self, call_id: int) -> None:
        """The caller is done with the call (answered or not)."""
        self._pending.pop(call_id, None)
        self._listeners.pop(call_id, None)

    def abandon(self, call_id: int, on_abandon: OnAbandon) -> None:
        """The caller left; `on_abandon` gets the worker's eventual answer."""
        self._abandoned[call_id] = on_abandon

    def fail_all(self, error: Exception) -> None:
        """The incarnation ended: every waiting call fails with `error`, every abandoned
        one's clean-up hears that no answer comes."""
        for future in self._pending.values():
            if not future.done():
                future.set_exception(error)
        self._pending.clear()
        for call_id in list(self._abandoned):
            self._answer_abandoned(call_id, None)

    def dispatch(self, message: dict[str, Any]) -> None:
        """Resolve the future of the call a decoded line answers, or hand a progress line
        to its listener, or a late answer to its abandoned caller's clean-up."""
        call_id = message.get("id", -1)
        if "event" in message:
            listener = self._listeners.get(call_id)
            data = message.get("data")
            if listener is not None and isinstance(data, dict):
                listener(str(message["event"]), data)
            return
        future = self._pending.get(call_id)
        if future is None or future.done():
            if call_id in self._abandoned:
                late = None if "error" in message else (message.get("result") or {})
                self._answer_abandoned(call_id, late)
            return
        if "error" in message:
            err = message["error"] or {}
            details = err.get("details")
            future.set_exception(
                WorkerCallError(
                    str(err.get("type", "Error")),
                    str(err.get("message", "")),
                    details if isinstance(details, dict) else None,
                )
            )
        else:
            future.set_result(message.get("result") or {})

    def _answer_abandoned(self, call_id: int, answer: dict[str, Any] | None) -> None:
        """Give an abandoned call's late answer (None: it failed, or the worker died) to its
        caller's on_abandon, for the cleanup of what a job that finished anyway made."""
        on_abandon = self._abandoned.pop(call_id, None)
        if on_abandon is None:
            return
        try:
            on_abandon(answer)
        except Exception:
            log.exception("cleanup after an abandoned %s call failed", call_id)
