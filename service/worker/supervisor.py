"""The server side of the worker seam: one supervised process per device.

Each `WorkerHandle` runs `python -m service.worker --device D` with pipes for the JSON-lines
protocol, waits for its hello (the platform profile), then pings it. A worker that exits,
is killed or stops answering is restarted with a growing back-off; calls in flight on it fail
with `WorkerUnavailableError`.

With several workers (one per GPU), the pool places work and remembers where each kept
layer lives:

* Readiness: the pool is ready while at least one worker is (a node with one GPU down still
  serves on the others; a call that names the down worker gets UNAVAILABLE). `all_ready`
  says whether every one is.
* Placement (`place`): a named worker index wins; otherwise the ready worker holding the
  fewest bytes of kept layers, then the one with the fewest calls in flight, ties taken in
  turn (round robin), so layers and load spread over the GPUs.
* Layers: each kept layer's id maps to its worker and that worker's incarnation. A worker
  that restarts loses its own layers only; their ids then answer NOT_FOUND saying which
  worker restarted and why (`LayerLostError`), the other workers' layers stay usable.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import re
import signal
import sys
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from service.oracle import InvalidSpecError, PlatformProfile
from service.worker import probe, protocol
from service.worker.errors import (
    LayerNotFoundError,
    WorkerCallError,
    WorkerNotFoundError,
    WorkerUnavailableError,
)

log = logging.getLogger("moe_control.supervisor")

#: Restart back-off never grows past this.
MAX_BACKOFF_S = 30.0
#: A worker that lived this long before dying restarts after the initial back-off again.
STABLE_AFTER_S = 60.0
_DEVICE = re.compile(r"^(cpu|cuda:\d+|xpu:\d+)$")
#: Most bytes read from a worker's answer pipe at once (asyncio's own pipe reads: 256 KiB).
READ_BYTES = 256 * 1024
#: Lost layer ids remembered for their explanation (oldest forgotten first).
MAX_LOST_LAYERS = 4096
#: ListWorkers waits this long for a worker's layer list (a hung worker shows none; the
#: supervisor's ping restarts it).
DESCRIBE_TIMEOUT_S = 5.0


class LayerLostError(LayerNotFoundError):
    """A kept layer whose worker restarted since it was loaded: gone with that process."""

    def __init__(self, layer_id: str, worker: int, device: str, reason: str) -> None:
        self.layer_id = layer_id
        self.worker_index = worker
        self.device = device
        self.reason = reason
        Exception.__init__(
            self,
            f"layer {layer_id!r} was held by worker {worker} ({device}), which restarted "
            f"({reason or 'reason unknown'}) and lost its layers; convert it again with "
            "keep_loaded (the other workers' layers are unaffected)",
        )


@dataclass(frozen=True, slots=True)
class LayerPlace:
    """Where a kept layer lives: its worker, that worker's incarnation, its size."""

    worker: int
    incarnation: int
    byte_size: int


class WorkerState(StrEnum):
    STARTING = "starting"
    READY = "ready"
    RESTARTING = "restarting"
    STOPPED = "stopped"


@dataclass(frozen=True, slots=True)
class SupervisorConfig:
    start_timeout_s: float = 180.0
    ping_interval_s: float = 5.0
    ping_timeout_s: float = 30.0
    restart_backoff_s: float = 1.0
    log_level: str = "INFO"
    log_format: str = "json"


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


class _WorkerDiedError(Exception):
    """The current incarnation ended; the message says how."""


def _exit_reason(returncode: int | None) -> str:
    if returncode is None:
        return "still running"
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exited with status {returncode}"


class _AnswerReader:
    """The read end of a worker's stdout pipe, read in the event loop's readiness callback
    (`loop.add_reader`): each complete line is handled where it was read. asyncio's
    subprocess stream instead fed a StreamReader whose reader task the loop then had to
    wake, one more pass of the loop per answer. The first line fills `hello`, the others go
    to `on_line`; `closed` gets why reading ended ("" at end of file, the worker gone)."""

    def __init__(self, fd: int, on_line: Callable[[bytes], None]) -> None:
        self._fd = fd
        self._on_line = on_line
        self._partial = b""
        self._loop = asyncio.get_running_loop()
        self.hello: asyncio.Future[bytes] = self._loop.create_future()
        self.closed: asyncio.Future[str] = self._loop.create_future()
        os.set_blocking(fd, False)
        self._loop.add_reader(fd, self._readable)

    def _readable(self) -> None:
        try:
            data = os.read(self._fd, READ_BYTES)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            self._close(f"cannot read its answers: {exc}")
            return
        if not data:
            self._close("")
            return
        lines = (self._partial + data).split(b"\n") if self._partial else data.split(b"\n")
        self._partial = lines.pop()
        if len(self._partial) > protocol.MAX_LINE_BYTES:
            self._close(f"protocol error: a line longer than {protocol.MAX_LINE_BYTES} bytes")
            return
        for line in lines:
            if self.closed.done():
                return
            if not self.hello.done():
                self.hello.set_result(line)
                continue
            try:
                self._on_line(line)
            except Exception as exc:  # a protocol error or a failing listener: worker is lost
                self._close(str(exc) or type(exc).__name__)
                return

    def _close(self, reason: str) -> None:
        if not self.closed.done():
            self.closed.set_result(reason)
        self.close()

    def close(self) -> None:
        """Stop reading and close the pipe (idempotent)."""
        if self._fd >= 0:
            self._loop.remove_reader(self._fd)
            os.close(self._fd)
            self._fd = -1
        if not self.closed.done():
            self.closed.set_result("")


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
        self._pending: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self._listeners: dict[int, Callable[[str, dict[str, Any]], None]] = {}
        #: Calls whose caller left (cancelled, timed out) while the worker still ran them:
        #: call id -> the caller's on_abandon, given the late answer (None: failed or died).
        self._abandoned: dict[int, Callable[[dict[str, Any] | None], None]] = {}
        self._next_id = 0
        self._stopping = False
        self._task: asyncio.Task[None] | None = None
        self._write_lock = asyncio.Lock()

    # -- public

    def start(self) -> None:
        self._task = asyncio.create_task(self._supervise(), name=f"worker-{self.index}")

    async def stop(self) -> None:
        self._stopping = True
        process = self.process
        if process is not None and process.returncode is None:
            if process.stdin is not None:
                process.stdin.close()
            try:
                await asyncio.wait_for(process.wait(), timeout=5.0)
            except TimeoutError:
                process.kill()
                await process.wait()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self._fail_pending(WorkerUnavailableError("the server is shutting down"))
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
        method: str,
        params: dict[str, Any] | None = None,
        *,
        timeout: float | None = None,
        on_event: Callable[[str, dict[str, Any]], None] | None = None,
        cancellable: bool = False,
        on_abandon: Callable[[dict[str, Any] | None], None] | None = None,
    ) -> dict[str, Any]:
        """Send one request and wait for its answer.

        `on_event` hears the call's progress lines. A `cancellable` call (a background job
        in the worker) that is cancelled here, or times out, is cancelled in the worker too,
        so it stops and frees what it holds; `on_abandon` then still gets the worker's
        eventual answer (None if it failed or the worker died), for the caller's cleanup of
        whatever a job that finished anyway made (a layer it kept, say)."""
        process = self.process
        if not self.ready or process is None or process.stdin is None:
            raise WorkerUnavailableError(f"worker {self.index} ({self.device}) is {self.state}")
        self._next_id += 1
        call_id = self._next_id
        future: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._pending[call_id] = future
        if on_event is not None:
            self._listeners[call_id] = on_event
        counted = method != "ping"
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
                    self._abandoned[call_id] = on_abandon
            raise
        finally:
            self.busy -= counted
            self._pending.pop(call_id, None)
            self._listeners.pop(call_id, None)

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

    def _cancel_in_worker(self, process: asyncio.subprocess.Process, call_id: int) -> None:
        """Tell the worker to stop a background call (fire and forget: nobody waits)."""
        if process.stdin is None or process.returncode is not None:
            return
        self._next_id += 1
        with contextlib.suppress(BrokenPipeError, ConnectionResetError, RuntimeError):
            process.stdin.write(protocol.request(self._next_id, "cancel", {"call_id": call_id}))

    # -- supervision

    def _set_state(self, state: WorkerState, *, notify: bool = False) -> None:
        """Change state; listeners hear of changes (and of every restart: `notify`)."""
        if state is not self.state or notify:
            self.state = state
            self.on_change(self)

    def _fail_pending(self, error: Exception) -> None:
        for future in self._pending.values():
            if not future.done():
                future.set_exception(error)
        self._pending.clear()
        for call_id in list(self._abandoned):
            self._answer_abandoned(call_id, None)

    async def _supervise(self) -> None:
        backoff = self.config.restart_backoff_s
        while not self._stopping:
            started = time.monotonic()
            reason = await self._run_once()
            if self._stopping:
                break
            self.last_exit_reason = reason
            self.ready_time = None
            self._fail_pending(
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
                    "backoff_s": backoff,
                },
            )
            if time.monotonic() - started > STABLE_AFTER_S:
                backoff = self.config.restart_backoff_s
            await asyncio.sleep(backoff)
            backoff = min(max(backoff * 2, 0.1), MAX_BACKOFF_S)

    async def _spawn(self) -> tuple[asyncio.subprocess.Process, _AnswerReader]:
        """Start an incarnation; its stdout is a pipe of ours read by `_AnswerReader`."""
        read_fd, write_fd = os.pipe()
        try:
            process = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "service.worker",
                "--device",
                self.device,
                "--log-format",
                self.config.log_format,
                "--log-level",
                self.config.log_level,
                stdin=asyncio.subprocess.PIPE,
                stdout=write_fd,
            )
        except BaseException:
            os.close(read_fd)
            raise
        finally:
            os.close(write_fd)
        return process, _AnswerReader(read_fd, self._answer)

    async def _run_once(self) -> str:
        """Run one incarnation until it dies; returns why it ended."""
        try:
            self.process, reader = await self._spawn()
        except OSError as exc:
            return f"could not start: {exc}"
        process = self.process
        if self.state is not WorkerState.RESTARTING:
            self._set_state(WorkerState.STARTING)
        ping: asyncio.Task[None] | None = None
        reason = ""
        try:
            await self._handshake(reader)
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
            await asyncio.wait((reader.closed, ping), return_when=asyncio.FIRST_COMPLETED)
            if reader.closed.done():
                reason = reader.closed.result()
            else:
                failure = ping.exception()
                reason = str(failure) if failure else ""
        except _WorkerDiedError as exc:
            reason = str(exc)
        finally:
            if ping is not None:
                ping.cancel()
            reader.close()
            if not self._stopping:
                await self._reap(process, hung=bool(reason))
        status = _exit_reason(process.returncode)
        return f"{reason} ({status})" if reason else status

    async def _reap(self, process: asyncio.subprocess.Process, *, hung: bool) -> None:
        """Collect the incarnation's exit status, killing it if it is (or may be) alive.

        A worker that closed its stdout is normally dead already: wait for asyncio to reap it
        rather than kill() at once, because Popen.send_signal() polls first and would reap it
        itself, losing the exit status ("killed by SIGKILL") to a blind 255."""
        if process.returncode is None and not hung:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(process.wait(), timeout=5.0)
        if process.returncode is None:
            process.kill()
        await process.wait()

    async def _handshake(self, reader: _AnswerReader) -> None:
        done, _ = await asyncio.wait(
            (reader.hello, reader.closed),
            timeout=self.config.start_timeout_s,
            return_when=asyncio.FIRST_COMPLETED,
        )
        if not done:
            raise _WorkerDiedError(f"no hello within {self.config.start_timeout_s:g} s")
        if not reader.hello.done():
            failure = reader.closed.result()
            raise _WorkerDiedError(
                f"bad hello: {failure}" if failure else "exited before its hello"
            )
        try:
            message = protocol.decode(reader.hello.result())
            if message.get("event") != "hello" or not isinstance(message.get("info"), dict):
                raise protocol.ProtocolError("the first message must be a hello")
            info: dict[str, Any] = message["info"]
            profile = PlatformProfile.from_json(info.get("platform") or {})
        except (protocol.ProtocolError, InvalidSpecError) as exc:
            raise _WorkerDiedError(f"bad hello: {exc}") from None
        self.info = info
        self.profile = profile

    def _answer(self, line: bytes) -> None:
        """Resolve the future of the call a line answers (or hand a progress line to its
        listener); `_AnswerReader` calls it for each line after the hello, in the event
        loop's own callback for the pipe, so the caller's task is the only one woken."""
        try:
            message = protocol.decode(line)
        except protocol.ProtocolError as exc:
            raise _WorkerDiedError(f"protocol error: {exc}") from None
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

    async def _ping_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.ping_interval_s)
            try:
                await self.call("ping", timeout=self.config.ping_timeout_s)
            except TimeoutError:
                raise _WorkerDiedError(
                    f"no answer to a ping within {self.config.ping_timeout_s:g} s"
                ) from None
            except WorkerUnavailableError:
                return


class WorkerPool:
    """Every worker of the server, by index; where each kept layer lives."""

    def __init__(
        self,
        devices: Sequence[str],
        config: SupervisorConfig,
        on_change: Callable[[WorkerHandle], None] | None = None,
    ) -> None:
        if not devices:
            raise ValueError("a worker pool needs at least one device")
        self._on_change = on_change
        self.workers = [
            WorkerHandle(i, device, config, self._changed) for i, device in enumerate(devices)
        ]
        self._ready_event = asyncio.Event()
        #: Moves on at every worker change, so answers derived from the workers' profiles
        #: (cached SelectBackend answers) know when they may be stale.
        self.generation = 0
        #: The layer budget each worker holds kept layers to (shown by `describe`; the
        #: conversion calls carry it to the workers). Set by the servicer from settings.
        self.layer_budget_bytes = 0
        self._layers: dict[str, LayerPlace] = {}
        self._lost: OrderedDict[str, LayerLostError] = OrderedDict()
        self._turn = 0

    def _changed(self, worker: WorkerHandle) -> None:
        self.generation += 1
        if worker.state is WorkerState.RESTARTING:
            self._lose_layers(worker)
        if self.ready:
            self._ready_event.set()
        else:
            self._ready_event.clear()
        if self._on_change is not None:
            self._on_change(worker)

    def start(self) -> None:
        for worker in self.workers:
            worker.start()

    async def stop(self) -> None:
        await asyncio.gather(*(w.stop() for w in self.workers))

    async def wait_ready(self, timeout: float | None = None) -> bool:
        """Until at least one worker is ready (False on timeout)."""
        try:
            await asyncio.wait_for(self._ready_event.wait(), timeout)
        except TimeoutError:
            return False
        return True

    @property
    def ready(self) -> bool:
        """At least one worker is ready: the server's readiness. A node keeps serving on
        its healthy GPUs while one worker restarts; calls for the restarting one (named by
        index, or holding the layer) get UNAVAILABLE or NOT_FOUND meanwhile."""
        return any(w.ready for w in self.workers)

    @property
    def all_ready(self) -> bool:
        return all(w.ready for w in self.workers)

    def ready_workers(self) -> list[WorkerHandle]:
        return [w for w in self.workers if w.ready]

    def worker(self, index: int) -> WorkerHandle:
        if not 0 <= index < len(self.workers):
            raise WorkerNotFoundError(index, len(self.workers))
        return self.workers[index]

    def profile(self, index: int) -> PlatformProfile:
        """The platform a ready worker reported."""
        worker = self.worker(index)
        if not worker.ready or worker.profile is None:
            raise WorkerUnavailableError(
                f"worker {index} ({worker.device}) is {worker.state}; its platform is not known "
                "until it is ready (name a preset or a platform for a what-if answer)"
            )
        return worker.profile

    def default_profile(self) -> PlatformProfile | None:
        """The first ready worker's platform (worker 0's while it is up), else None."""
        for worker in self.workers:
            if worker.ready and worker.profile is not None:
                return worker.profile
        return None

    def snapshots(self) -> list[WorkerSnapshot]:
        return [w.snapshot() for w in self.workers]

    async def describe(self) -> list[WorkerSnapshot]:
        """Snapshots with each ready worker's kept layers (ids, bytes) and the budget."""
        held = await asyncio.gather(
            *(self._held(w, timeout=DESCRIBE_TIMEOUT_S) for w in self.workers),
            return_exceptions=True,
        )
        out = []
        for worker, layers in zip(self.workers, held, strict=True):
            listed = layers if isinstance(layers, list) else []
            out.append(
                dataclasses.replace(
                    worker.snapshot(),
                    layer_bytes=sum(int(layer.get("byte_size", 0)) for layer in listed),
                    layer_budget_bytes=self.layer_budget_bytes,
                    layer_ids=tuple(str(layer.get("layer_id", "")) for layer in listed),
                )
            )
        return out

    async def _held(
        self, worker: WorkerHandle, *, timeout: float | None = None
    ) -> list[dict[str, Any]]:
        """The layers a worker lists (empty while it is not ready); prunes the directory
        of this worker's ids it no longer holds (evicted to make room)."""
        if not worker.ready:
            return []
        incarnation = worker.incarnation
        answer = await worker.call("list_layers", timeout=timeout)
        layers = [dict(layer) for layer in answer.get("layers", [])]
        if worker.incarnation == incarnation:
            listed = {str(layer.get("layer_id")) for layer in layers}
            for layer_id, place in list(self._layers.items()):
                if place.worker == worker.index and layer_id not in listed:
                    del self._layers[layer_id]
            for layer in layers:
                self._layers.setdefault(
                    str(layer.get("layer_id")),
                    LayerPlace(worker.index, incarnation, int(layer.get("byte_size", 0))),
                )
        return layers

    async def list_layers(self, index: int | None = None) -> list[dict[str, Any]]:
        targets = self.workers if index is None else [self.worker(index)]
        layers: list[dict[str, Any]] = []
        for worker in targets:
            for layer in await self._held(worker):
                layers.append({**layer, "worker_index": worker.index})
        return layers

    # -- placement and the layer directory

    def place(self, index: int | None = None, *, by_memory: bool = False) -> WorkerHandle:
        """The worker a new piece of work goes to: worker `index` when one is named;
        otherwise a ready worker, the one holding the fewest kept-layer bytes first when
        `by_memory` (a layer to keep), then the one with the fewest calls in flight, ties
        taken in turn. No ready worker: WorkerUnavailableError."""
        if index is not None:
            return self.worker(index)
        ready = self.ready_workers()
        if not ready:
            raise WorkerUnavailableError("no worker is ready")
        held = self.held_bytes() if by_memory else {}
        count = len(self.workers)
        turn = self._turn
        self._turn += 1
        return min(
            ready,
            key=lambda w: (held.get(w.index, 0), w.busy, (w.index - turn) % count),
        )

    def held_bytes(self) -> dict[int, int]:
        """Kept-layer bytes by worker index, as the directory knows them."""
        out: dict[int, int] = {}
        for place in self._layers.values():
            out[place.worker] = out.get(place.worker, 0) + place.byte_size
        return out

    def remember(self, layer_id: str, worker: WorkerHandle, byte_size: int = 0) -> None:
        """A layer `worker` keeps from now on (ConvertWeights with keep_loaded)."""
        self._lost.pop(layer_id, None)
        self._layers[layer_id] = LayerPlace(worker.index, worker.incarnation, byte_size)

    def forget(self, layer_id: str) -> None:
        self._layers.pop(layer_id, None)

    def _lose_layers(self, worker: WorkerHandle) -> None:
        """A worker died: its layers are gone; remember why, for the callers that ask."""
        for layer_id, place in list(self._layers.items()):
            if place.worker != worker.index:
                continue
            del self._layers[layer_id]
            self._lost[layer_id] = LayerLostError(
                layer_id, worker.index, worker.device, worker.last_exit_reason
            )
            while len(self._lost) > MAX_LOST_LAYERS:
                self._lost.popitem(last=False)

    async def holder(self, layer_id: str) -> WorkerHandle:
        """The worker that holds `layer_id`. A layer its worker lost in a restart is
        LayerLostError; one no worker has is LayerNotFoundError. The directory answers
        without a call; a layer it does not know is looked for on every ready worker."""
        place = self._layers.get(layer_id)
        if place is not None:
            worker = self.workers[place.worker]
            if worker.incarnation == place.incarnation:
                return worker
            self._layers.pop(layer_id, None)
            raise LayerLostError(layer_id, worker.index, worker.device, worker.last_exit_reason)
        lost = self._lost.get(layer_id)
        if lost is not None:
            raise lost
        for layer in await self.list_layers():
            if layer.get("layer_id") == layer_id:
                return self.workers[int(layer["worker_index"])]
        raise LayerNotFoundError(layer_id)

    async def unload_layer(self, layer_id: str) -> int:
        """Drop a converted layer from the worker that holds it; returns the bytes freed."""
        worker = await self.holder(layer_id)
        answer = await worker.call("unload_layer", {"layer_id": layer_id})
        self.forget(layer_id)
        if not answer.get("found"):
            raise LayerNotFoundError(layer_id)
        return int(answer.get("freed_bytes", 0))


async def discover_devices(spec: str, *, cpu_workers: int = 1, timeout: float = 120.0) -> list[str]:
    """The devices to start workers on: 'auto', 'cpu' or a comma-separated list; one worker
    each. Where that comes to the CPU alone ('cpu', or 'auto' without a GPU), `cpu_workers`
    CPU workers (more than one only to exercise the multi-worker paths without GPUs).

    'auto' asks a throwaway process (torch must not initialise CUDA in the server); without
    torch installed it is the CPU at once.
    """
    devices = await _devices(spec.strip(), timeout)
    if devices == [probe.CPU]:
        return [probe.CPU] * max(1, cpu_workers)
    return devices


async def _devices(spec: str, timeout: float) -> list[str]:
    if spec == "auto":
        if not probe.torch_available():
            return [probe.CPU]
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "service.worker",
            "--list-devices",
            stdout=asyncio.subprocess.PIPE,
        )
        out, _ = await asyncio.wait_for(process.communicate(), timeout)
        devices = json.loads(out.decode().strip().splitlines()[-1]) if out.strip() else []
        return [str(d) for d in devices] or [probe.CPU]
    devices = [d.strip() for d in spec.split(",") if d.strip()]
    bad = [d for d in devices if not _DEVICE.match(d)]
    if bad or not devices:
        raise ValueError(f"devices: expected 'auto', 'cpu' or e.g. 'cuda:0,cuda:1'; got {spec!r}")
    return devices
