"""One device's worker, as the server sees it: its current process, its state, its calls.

A `WorkerHandle` supervises one `python -m service.worker --device D`: starts it, waits for
its hello, pings it, and restarts it with a growing back-off when it exits, is killed or
stops answering (`spawn`, `restart`); calls in flight on it then fail with
`WorkerUnavailableError`. Its calls are typed requests (`service.ipc.messages`), sent as
JSON lines (`service.ipc.protocol`) whose answers `InFlightCalls` routes back to the
waiting caller, decoded into the request's answer type.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, TypeVar

from service.ipc import codec, protocol
from service.ipc.errors import ProtocolError
from service.ipc.messages import Cancel, Ping, Request
from service.oracle import PlatformProfile
from service.pool import spawn
from service.pool.calls import InFlightCalls, Listener, OnAbandon
from service.pool.config import SupervisorConfig
from service.pool.errors import WorkerCallError, WorkerDiedError, WorkerUnavailableError
from service.pool.reader import AnswerReader
from service.pool.restart import RestartBackoff, exit_reason

log = logging.getLogger("moe_control.supervisor")
A = TypeVar("A")


class WorkerState(StrEnum):
    STARTING = "starting"
    READY = "ready"
    RESTARTING = "restarting"
    STOPPED = "stopped"


@dataclass(frozen=True, slots=True)
class WorkerSnapshot:
    """A worker as ListWorkers shows it."""

    index: int
    device: str
    state: WorkerState
    pid: int
    restarts: int
    profile: PlatformProfile | None
    device_name: str
    total_memory_bytes: int
    torch_version: str
    ready_time: float | None
    last_exit_reason: str
    #: Bytes of kept layers it holds, and their ids (least recently used first); filled in
    #: by `WorkerPool.describe` (which asks the worker), else zero and empty.
    layer_bytes: int = 0
    layer_budget_bytes: int = 0
    layer_ids: tuple[str, ...] = ()


class WorkerHandle:
    """One device's worker: its current process, state and pending calls."""

    def __init__(
        self,
        index: int,
        device: str,
        config: SupervisorConfig,
        on_change: Callable[[WorkerHandle], None],
    ) -> None:
        self.index = index
        self.device = device
        self.config = config
        self.on_change = on_change
        self.state = WorkerState.STARTING
        self.process: asyncio.subprocess.Process | None = None
        self.info: dict[str, Any] = {}
        self.profile: PlatformProfile | None = None
        self.restarts = 0
        #: Moves on each time a new process becomes ready: layers of older ones are gone.
        self.incarnation = 0
        #: Calls in flight (pings excluded): the tie-breaker of placement.
        self.busy = 0
        self.ready_time: float | None = None
        self.last_exit_reason = ""
        self._calls = InFlightCalls()
        self._stopping = False
        self._task: asyncio.Task[None] | None = None
        self._write_lock = asyncio.Lock()

    # -- public

    def start(self) -> None:
        self._task = asyncio.create_task(self._supervise(), name=f"worker-{self.index}")

    async def stop(self) -> None:
        self._stopping = True
        if self.process is not None:
            await spawn.stop(self.process)
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self._calls.fail_all(WorkerUnavailableError("the server is shutting down"))
        self._set_state(WorkerState.STOPPED)

    @property
    def ready(self) -> bool:
        return self.state is WorkerState.READY

    def snapshot(self) -> WorkerSnapshot:
        process = self.process
        alive = process is not None and process.returncode is None
        return WorkerSnapshot(
            index=self.index,
            device=self.device,
            state=self.state,
            pid=process.pid if alive and process is not None else 0,
            restarts=self.restarts,
            profile=self.profile,
            device_name=str(self.info.get("device_name", "")),
            total_memory_bytes=int(self.info.get("total_memory_bytes", 0)),
            torch_version=str(self.info.get("torch_version", "")),
            ready_time=self.ready_time,
            last_exit_reason=self.last_exit_reason,
        )

    async def call(
        self,
        request: Request[A],
        *,
        timeout: float | None = None,
        on_event: Listener | None = None,
        on_abandon: Callable[[A | None], None] | None = None,
    ) -> A:
        """Send one request and wait for its answer.

        `on_event` hears the call's progress lines. A background request (a job in the
        worker) that is cancelled here, or times out, is cancelled in the worker too, so it
        stops and frees what it holds; `on_abandon` then still gets the worker's eventual
        answer (None if it failed or the worker died), for the caller's cleanup of whatever
        a job that finished anyway made (a layer it kept, say)."""
        kind = request.answer_type()
        late: OnAbandon | None = None
        if on_abandon is not None:
            hear = on_abandon

            def late(answer: dict[str, Any] | None) -> None:
                hear(None if answer is None else codec.from_json(kind, answer))

        answer = await self._call(
            request.METHOD,
            codec.to_json(request),
            timeout=timeout,
            on_event=on_event,
            cancellable=request.BACKGROUND,
            on_abandon=late,
        )
        try:
            return codec.from_json(kind, answer)
        except ProtocolError as exc:
            raise WorkerCallError(
                "ProtocolError", f"a malformed {request.METHOD} answer: {exc}"
            ) from None

    async def _call(
        self,
        method: str,
        params: dict[str, Any],
        *,
        timeout: float | None,
        on_event: Listener | None,
        cancellable: bool,
        on_abandon: OnAbandon | None,
    ) -> dict[str, Any]:
        """`call` on the pipe: the request's JSON out, the answer's JSON back."""
        process = self.process
        if not self.ready or process is None or process.stdin is None:
            raise WorkerUnavailableError(f"worker {self.index} ({self.device}) is {self.state}")
        call_id = self._calls.next_id()
        future = self._calls.open(call_id, on_event)
        counted = method != Ping.METHOD
        self.busy += counted
        try:
            async with self._write_lock:
                process.stdin.write(protocol.request(call_id, method, params))
                await process.stdin.drain()
            # Awaited directly, not through asyncio.shield: the shield's outer future cost
            # one more pass of the event loop per answer. A caller that leaves cancels the
            # future; whether the worker still runs the job is then "not answered yet"
            # (cancelled, or still pending), and its late answer goes to on_abandon.
            if timeout is None:
                return await future
            return await asyncio.wait_for(future, timeout)
        except (BrokenPipeError, ConnectionResetError):
            raise WorkerUnavailableError(
                f"worker {self.index} ({self.device}) went away during {method}"
            ) from None
        except (asyncio.CancelledError, TimeoutError):
            if cancellable and (future.cancelled() or not future.done()):
                self._cancel_in_worker(process, call_id)
                if on_abandon is not None:
                    self._calls.abandon(call_id, on_abandon)
            raise
        finally:
            self.busy -= counted
            self._calls.close(call_id)

    def _cancel_in_worker(self, process: asyncio.subprocess.Process, call_id: int) -> None:
        """Tell the worker to stop a background call (fire and forget: nobody waits)."""
        if process.stdin is None or process.returncode is not None:
            return
        request = Cancel(call_id)
        cancel = protocol.request(self._calls.next_id(), request.METHOD, codec.to_json(request))
        with contextlib.suppress(BrokenPipeError, ConnectionResetError, RuntimeError):
            process.stdin.write(cancel)

    # -- supervision

    def _set_state(self, state: WorkerState, *, notify: bool = False) -> None:
        """Change state; listeners hear of changes (and of every restart: `notify`)."""
        if state is not self.state or notify:
            self.state = state
            self.on_change(self)

    async def _supervise(self) -> None:
        backoff = RestartBackoff(self.config.restart_backoff_s)
        while not self._stopping:
            started = time.monotonic()
            reason = await self._run_once()
            if self._stopping:
                break
            self.last_exit_reason = reason
            self.ready_time = None
            self._calls.fail_all(
                WorkerUnavailableError(f"worker {self.index} ({self.device}) died: {reason}")
            )
            self.restarts += 1
            self._set_state(WorkerState.RESTARTING, notify=True)
            log.warning(
                "worker died; restarting",
                extra={
                    "event": "worker_restart",
                    "worker": self.index,
                    "device": self.device,
                    "reason": reason,
                    "restarts": self.restarts,
                    "backoff_s": backoff.delay,
                },
            )
            await asyncio.sleep(backoff.wait_after(time.monotonic() - started))

    async def _run_once(self) -> str:
        """Run one incarnation until it dies; returns why it ended."""
        try:
            self.process, reader = await spawn.spawn(self.device, self.config, self._answer)
        except OSError as exc:
            return f"could not start: {exc}"
        process = self.process
        if self.state is not WorkerState.RESTARTING:
            self._set_state(WorkerState.STARTING)
        ping: asyncio.Task[None] | None = None
        reason = ""
        try:
            self.info, self.profile = await spawn.handshake(reader, self.config.start_timeout_s)
            self.ready_time = time.time()
            self.incarnation += 1
            self._set_state(WorkerState.READY)
            log.info(
                "worker ready",
                extra={
                    "event": "worker_ready",
                    "worker": self.index,
                    "device": self.device,
                    "pid": process.pid,
                    "platform": self.info.get("platform"),
                },
            )
            ping = asyncio.create_task(self._ping_loop())
            reason = await self._until_ended(reader, ping)
        except WorkerDiedError as exc:
            reason = str(exc)
        finally:
            if ping is not None:
                ping.cancel()
            reader.close()
            if not self._stopping:
                await spawn.reap(process, hung=bool(reason))
        status = exit_reason(process.returncode)
        return f"{reason} ({status})" if reason else status

    @staticmethod
    async def _until_ended(reader: AnswerReader, ping: asyncio.Task[None]) -> str:
        """Until the answer pipe closes or the pings fail; why ("" at a plain exit)."""
        await asyncio.wait((reader.closed, ping), return_when=asyncio.FIRST_COMPLETED)
        if reader.closed.done():
            return reader.closed.result()
        failure = ping.exception()
        return str(failure) if failure else ""

    def _answer(self, line: bytes) -> None:
        """Route one answer line to its call; `AnswerReader` calls it for each line after
        the hello, in the event loop's own callback for the pipe, so the caller's task is
        the only one woken."""
        try:
            message = protocol.decode(line)
        except ProtocolError as exc:
            raise WorkerDiedError(f"protocol error: {exc}") from None
        self._calls.dispatch(message)

    async def _ping_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.ping_interval_s)
            try:
                await self.call(Ping(), timeout=self.config.ping_timeout_s)
            except TimeoutError:
                raise WorkerDiedError(
                    f"no answer to a ping within {self.config.ping_timeout_s:g} s"
                ) from None
            except WorkerUnavailableError:
                return
