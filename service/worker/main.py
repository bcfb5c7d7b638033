"""The worker process: `python -m service.worker --device cuda:0`.

It owns one device. Each request line is decoded into the request type its method names
(`service.ipc.messages.REQUESTS`) and dispatched on that type: quick ones answered inline
(`Worker.handlers`), background ones started as jobs (`BACKGROUND`). Its stdout carries
the JSON-lines protocol only (fd 1 is pointed at stderr after the protocol stream is set
aside, so a library that prints cannot corrupt it); its logs go to stderr. It exits when
its stdin closes (the server went away).
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, BinaryIO

from service.formats.errors import ConversionUnsupported
from service.ipc import codec, protocol
from service.ipc.errors import ProtocolError
from service.ipc.messages import (
    REQUESTS,
    Cancel,
    Cancelled,
    CheckTarget,
    ConvertCheckpoint,
    ConvertLayer,
    LayersListed,
    LayerUnloaded,
    ListLayers,
    MeasureBackends,
    Ping,
    Pong,
    Profile,
    Request,
    RunMoE,
    TargetChecked,
    UnloadLayer,
    WorkerProfile,
)
from service.worker import jobs, probe
from service.worker.context import Job
from service.worker.layers import LayerStore

if TYPE_CHECKING:
    from service.worker.streams import Streams
    from service.worker.transport import Transport

log = logging.getLogger("moe_control.worker")

#: Background requests (they run on job threads; see jobs.py): type -> "module:function",
#: imported on first use so a worker that never converts never imports torch for it. The
#: function takes (worker, request, job context) and returns the request's answer.
BACKGROUND: dict[type[Request[Any]], str] = {
    ConvertLayer: "service.worker.convert:convert_layer",
    ConvertCheckpoint: "service.worker.convert:convert_checkpoint",
    RunMoE: "service.worker.run:run_moe",
    MeasureBackends: "service.worker.measure:measure_backends",
}


class Worker:
    """The worker's request handlers: quick ones answer inline, long ones run as jobs."""

    def __init__(self, device: str, send: Callable[[bytes], None] | None = None) -> None:
        self.device = device
        self.info = probe.probe(device)
        self.layers = LayerStore()
        self.jobs = jobs.Jobs(send or (lambda line: None))
        self._lazy_lock = threading.Lock()
        self._streams: Streams | None = None
        self._transport: Transport | None = None
        self._kernels: dict[str, Any] | None = None
        self._background: dict[type[Request[Any]], tuple[jobs.Handler, str]] = {}
        #: The quick requests, answered inline: request type -> its handler.
        self.handlers: dict[type[Request[Any]], Callable[[Any], object]] = {
            Ping: self.ping,
            Profile: self.profile,
            ListLayers: self.list_layers,
            UnloadLayer: self.unload_layer,
            Cancel: self.cancel,
            CheckTarget: self.check_target,
        }

    @property
    def streams(self) -> Streams:
        """One CUDA stream per request class (streams.py); made on first use (torch)."""
        with self._lazy_lock:
            if self._streams is None:
                from service.worker.streams import Streams

                self._streams = Streams(self.device)
            return self._streams

    @property
    def transport(self) -> Transport:
        """Segment <-> device copies through pinned staging (transport.py)."""
        with self._lazy_lock:
            if self._transport is None:
                from service.worker.transport import Transport

                self._transport = Transport(self.device)
            return self._transport

    def background(self, kind: type[Request[Any]]) -> jobs.Handler:
        """The job for requests of type `kind`, run on its request class's stream."""
        return self.job(kind)[0]

    def job(self, kind: type[Request[Any]]) -> tuple[jobs.Handler, str]:
        """`background(kind)` and its request class (which kept job threads run it:
        jobs.py). Made once per type: the import and lookup are not paid per call."""
        found = self._background.get(kind)
        if found is not None:
            return found
        module_name, _, function = BACKGROUND[kind].partition(":")
        target: Job = getattr(importlib.import_module(module_name), function)
        from service.worker.streams import request_class

        stream = request_class(kind.METHOD)

        def handler(request: Any, context: jobs.JobContext) -> dict[str, Any]:
            with self.streams.scope(stream):
                answer = target(self, request, context)
            return codec.to_json(answer)

        self._background[kind] = handler, stream
        return handler, stream

    def check_target(self, request: CheckTarget) -> TargetChecked:
        """Whether this worker can write a backend's layout (asked before data moves)."""
        from service.formats import registry

        try:
            registry.writer_for(request.backend)
        except ConversionUnsupported as exc:
            return TargetChecked(False, exc.reason)
        return TargetChecked(True)

    def cancel(self, request: Cancel) -> Cancelled:
        return Cancelled(self.jobs.cancel(request.call_id))

    def ping(self, request: Ping) -> Pong:
        return Pong(os.getpid())

    def profile(self, request: Profile) -> WorkerProfile:
        """The hello's profile and each backend's availability on this device (worked out
        on the first call: it imports torch and loads vLLM's Marlin library)."""
        if self._kernels is None:
            import torch

            from service.worker.run import kernel_status

            self._kernels = kernel_status(torch.device(self.device))
        return WorkerProfile(self.info, self._kernels)

    def list_layers(self, request: ListLayers) -> LayersListed:
        return LayersListed(tuple(self.layers.infos()))

    def unload_layer(self, request: UnloadLayer) -> LayerUnloaded:
        layer = self.layers.pop(request.layer_id)
        if layer is None:
            return LayerUnloaded(False)
        return LayerUnloaded(True, int(layer.info.get("byte_size", 0)))

    def handle(self, line: bytes) -> bytes | None:
        """The answer to one request line; None when it started a background job (which
        answers by itself when it ends)."""
        try:
            message = protocol.decode(line)
        except ProtocolError as exc:
            return protocol.error(-1, "ProtocolError", str(exc))
        call_id = message.get("id")
        if not isinstance(call_id, int):
            return protocol.error(-1, "ProtocolError", "a request needs an integer id")
        method = str(message.get("method"))
        kind = REQUESTS.get(method)
        if kind is None:
            return protocol.error(call_id, "UnknownMethod", f"no method {message.get('method')!r}")
        try:
            request = codec.from_json(kind, message.get("params") or {}, method)
        except ProtocolError as exc:
            return protocol.error(call_id, "ProtocolError", str(exc))
        if kind.BACKGROUND:
            try:
                job, stream = self.job(kind)
                self.jobs.start(call_id, method, job, request, kind=stream)
            except Exception as exc:
                log.exception("cannot start %s", method)
                return protocol.error(call_id, *jobs.describe(exc))
            return None
        try:
            return protocol.result(call_id, codec.to_json(self.handlers[kind](request)))
        except Exception as exc:
            log.exception("worker call %s failed", method)
            return protocol.error(call_id, type(exc).__name__, str(exc))


def serve(device: str, stdin: BinaryIO, stdout: BinaryIO) -> int:
    lock = threading.Lock()
    fd = stdout.fileno()

    def send(line: bytes) -> None:
        """Write one protocol line (background jobs write from their own threads): straight
        to the pipe's descriptor, one write for a line that fits the pipe, no buffer to copy
        into and flush."""
        with lock:
            view = memoryview(line)
            while view:
                view = view[os.write(fd, view) :]

    worker = Worker(device, send)
    send(protocol.hello(worker.info))
    log.info("worker ready", extra={"device": device, "platform": worker.info.get("platform")})
    try:
        for line in stdin:
            answer = worker.handle(line)
            if answer is not None:
                send(answer)
    finally:
        worker.jobs.cancel_all()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m service.worker")
    parser.add_argument("--device", default="cpu", help="device to own: cpu, cuda:N, xpu:N")
    parser.add_argument(
        "--list-devices", action="store_true", help="print the visible devices as JSON and exit"
    )
    parser.add_argument("--log-format", default="json", choices=("json", "text"))
    parser.add_argument("--log-level", default="INFO")
    args = parser.parse_args(argv)
    # Before any thread starts: glibc's defaults let the heap grow under load (memory.py).
    from service.process import tune_malloc

    tune_malloc()
    from service.logs import configure_logging

    configure_logging(args.log_level, args.log_format)
    if args.list_devices:
        print(json.dumps(probe.visible_devices()))
        return 0
    # Ctrl-C in a terminal reaches the whole process group; the server decides when the
    # worker ends (it closes stdin, then terminates it).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # Keep the protocol stream to ourselves: whatever else writes to fd 1 lands on stderr.
    proto_out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    try:
        return serve(args.device, sys.stdin.buffer, proto_out)
    except BrokenPipeError:
        return 0
